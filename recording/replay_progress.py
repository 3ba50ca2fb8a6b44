"""What ``lig replay`` tells its user while it runs (on stderr: stdout keeps the summary).

The total a progress line names comes from a second, concurrent pass over the file
(:func:`survey`): the file's header does not say how many records it holds, and counting them
before publishing would delay the first snapshot of a long recording by seconds (about 2 s
per million records), where the user is waiting for the fleet to appear.
"""

from __future__ import annotations

import os
import threading

import msgspec

from recording.fileformat import Kind, RecordingError, read_entries, read_header
from recording.window import format_duration

# The frames replay publishes; decisions are never published (recording.replay).
PUBLISHED_KINDS = frozenset({Kind.REGISTRY_STATE, Kind.REGISTRY_CHANGE, Kind.SNAPSHOT})
# Frames published at their recorded time, which sets the recording's span.
TIMED_KINDS = frozenset({Kind.REGISTRY_CHANGE, Kind.SNAPSHOT})


class Survey(msgspec.Struct, frozen=True):
    """What a recording holds for replay: how many records it will publish, and the store
    times of the first and last it publishes at their time (None: it has none)."""

    records: int
    first_ns: int | None
    last_ns: int | None


def survey(path: str, cancelled: threading.Event) -> Survey | None:
    """Count what replaying ``path`` publishes, reading it on its own (run in a thread, beside
    the replay); None when it cannot be read again from its start (a pipe: reopening it would
    take the replay's bytes), is bad (the replay reports that itself when it gets there), or
    ``cancelled`` is set."""
    if not os.path.isfile(path):
        return None
    records = 0
    first_ns: int | None = None
    last_ns: int | None = None
    try:
        with open(path, "rb") as source:
            read_header(source)
            for kind, entry in read_entries(source):
                if cancelled.is_set():
                    return None
                if kind in PUBLISHED_KINDS:
                    records += 1
                if kind in TIMED_KINDS:
                    first_ns = entry.time_ns if first_ns is None else first_ns
                    last_ns = entry.time_ns
    except (OSError, RecordingError):
        return None
    return Survey(records, first_ns, last_ns)


def lead_in_line(window_from_ns: int, first_ns: int, notice_after_s: float) -> str | None:
    """The line saying replay skips the window's empty start, if it is longer than
    ``notice_after_s`` (a live fleet's first snapshot follows the window start within a scrape
    interval: not worth a line)."""
    lead_in_s = (first_ns - window_from_ns) / 1e9
    if lead_in_s <= notice_after_s:
        return None
    return (f"lig replay: the window starts {format_duration(lead_in_s)} before the first "
            "record: starting at the first record")


def progress_line(published: int, position_s: float, found: Survey | None) -> str:
    """One progress line: records published (of how many, once counted) and how far into the
    recording the replay is (recorded time since its first record)."""
    if found is None or found.first_ns is None or found.last_ns is None:
        return (f"lig replay: {published} records published, "
                f"at {format_duration(position_s)} of the recording")
    span_s = (found.last_ns - found.first_ns) / 1e9
    share = 100.0 * published / found.records if found.records else 100.0
    return (f"lig replay: {published}/{found.records} records published ({share:.0f}%), "
            f"at {format_duration(min(position_s, span_s))} of "
            f"{format_duration(span_s)} recorded")
