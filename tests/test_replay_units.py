"""``lig replay``'s pure logic: recorded time onto the replay's clock (no waiting through the
window's empty start), the lead-in and progress lines, the count of what a file will publish,
and durations for a human."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from recording.fileformat import Entry, FileHeader, Kind, Writer
from recording.replay import Timeline, retimed
from recording.replay_progress import Survey, lead_in_line, progress_line, survey
from recording.window import format_duration
from shared.schemas import PodMetrics, decode, encode

SECOND = 1_000_000_000
FIRST = 1_700_000_000 * SECOND  # the first record's store time
WALL = 1_800_000_000 * SECOND  # the wall clock when the replay starts


@pytest.mark.parametrize(("seconds", "text"), [
    (0.0, "0.0s"), (0.44, "0.4s"), (9.94, "9.9s"), (42.4, "42s"), (60, "1m00s"),
    (552, "9m12s"), (3725, "1h02m05s")])
def test_durations_for_a_human(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_the_first_record_is_due_at_once_and_the_spacing_is_kept_scaled() -> None:
    timeline = Timeline(first_ns=FIRST, start_mono=100.0, start_wall_ns=WALL, speed=2.0)
    assert timeline.due(FIRST) == 100.0
    assert timeline.due(FIRST + 4 * SECOND) == pytest.approx(102.0)
    assert timeline.position_s(103.0) == pytest.approx(6.0)
    assert timeline.position_s(99.0) == 0.0


def test_scrape_times_move_onto_the_replay_clock_as_the_records_do() -> None:
    """A snapshot scraped 30 ms before it was stored is 15 ms old (speed 2) when published; one
    recorded 10 minutes after the first record is published 5 minutes in, dated then."""
    timeline = Timeline(first_ns=FIRST, start_mono=0.0, start_wall_ns=WALL, speed=2.0)
    assert timeline.wall_ns(FIRST - 30_000_000) == WALL - 15_000_000
    later = PodMetrics(pool="p", pod="a", address="127.0.0.1:8000", seq=7,
                       scrape_time_ns=FIRST + 600 * SECOND, scrape_duration_s=0.001, ok=True,
                       waiting=3)
    replayed = retimed(encode(later), timeline)
    assert replayed is not None
    moved = decode(replayed, PodMetrics)
    assert moved.scrape_time_ns == WALL + 300 * SECOND
    assert (moved.seq, moved.waiting, moved.pod) == (7, 3, "a")
    assert retimed(b"not a snapshot", timeline) is None


def test_a_long_empty_start_of_the_window_is_announced_a_scrape_interval_is_not() -> None:
    line = lead_in_line(FIRST - 552 * SECOND, FIRST, notice_after_s=1.0)
    assert line == ("lig replay: the window starts 9m12s before the first record: starting at "
                    "the first record")
    assert lead_in_line(FIRST - 50_000_000, FIRST, notice_after_s=1.0) is None


def test_progress_names_the_total_and_the_span_once_counted() -> None:
    assert progress_line(120, 65.0, None) == (
        "lig replay: 120 records published, at 1m05s of the recording")
    found = Survey(records=480, first_ns=FIRST, last_ns=FIRST + 290 * SECOND)
    assert progress_line(120, 65.0, found) == (
        "lig replay: 120/480 records published (25%), at 1m05s of 4m50s recorded")
    # Late timers do not show a position past the end.
    assert progress_line(480, 300.0, found).endswith("at 4m50s of 4m50s recorded")
    registry_only = Survey(records=2, first_ns=None, last_ns=None)
    assert progress_line(2, 0.0, registry_only) == (
        "lig replay: 2 records published, at 0.0s of the recording")


def write(path: Path) -> None:
    with path.open("wb") as out:
        writer = Writer(out, FileHeader(0, FIRST - 600 * SECOND, FIRST + 60 * SECOND, "lig"))
        writer.add(Kind.REGISTRY_STATE, Entry(0, "pool.p", b"pool"))
        writer.add(Kind.DECISION, Entry(FIRST - SECOND, "decisions.p", b"never published"))
        writer.add(Kind.SNAPSHOT, Entry(FIRST, "metrics.p.a", b"s"))
        writer.add(Kind.REGISTRY_CHANGE, Entry(FIRST + 5 * SECOND, "endpoints.p", None))
        writer.add(Kind.SNAPSHOT, Entry(FIRST + 9 * SECOND, "metrics.p.a", b"s"))
        writer.close()


def test_the_survey_counts_what_replay_publishes(tmp_path: Path) -> None:
    path = tmp_path / "r.ligrec"
    write(path)
    assert survey(str(path), threading.Event()) == Survey(
        records=4, first_ns=FIRST, last_ns=FIRST + 9 * SECOND)


def test_the_survey_gives_up_on_what_it_cannot_read_again(tmp_path: Path) -> None:
    path = tmp_path / "r.ligrec"
    write(path)
    cancelled = threading.Event()
    cancelled.set()
    assert survey(str(path), cancelled) is None
    (tmp_path / "cut.ligrec").write_bytes(path.read_bytes()[:-5])
    assert survey(str(tmp_path / "cut.ligrec"), threading.Event()) is None
    assert survey(str(tmp_path), threading.Event()) is None  # not a regular file
