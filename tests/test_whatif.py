"""``lig replay --what-if``: recordings decided by the real policies (draw contract), re-decided
offline. The recorded policy reproduces every pick (also across a registry change and for the
stateful round-robin); another policy disagrees and is ranked; the reader streams, skips and
counts what it cannot decode, and keeps the one-line errors of a bad file."""

from __future__ import annotations

import io
import json
import logging
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from lig.cli import main
from recording.fileformat import (
    Entry,
    FileHeader,
    Kind,
    RecordingError,
    Writer,
    read_header,
)
from recording.records import ReadCounts, Registry, read_records
from recording.rerun import DeferredSeedRandom, parse_policy_specs, split_specs
from recording.whatif import what_if
from scheduling import PolicyConfigError, policy_names
from scheduling.record import RecordBatch
from shared.schemas import InferencePool, PolicyConfig, encode
from tests.support.recorded_decisions import (
    START_NS,
    Recorder,
    Spec,
    random_record,
    random_view,
    write,
)

STRICT = PolicyConfig("filter-tree", {"queue_threshold_critical": 0, "kv_cache_threshold": 0.0})


@pytest.fixture(autouse=True)
def _root_logging() -> Iterator[None]:
    """``lig replay`` sets up logging for its process; in-process runs must not leave it."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def report_of(path: Path, policies: str, top: int = 5, pool: str | None = None):
    with path.open("rb") as source:
        header = read_header(source)
        return what_if(source, header, parse_policy_specs(policies), top, pool)


def replay_json(capsys, *args: str) -> dict:
    assert main(["replay", *args, "--what-if", "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one JSON object on one line
    return json.loads(out)


@pytest.mark.parametrize("policy", policy_names())
def test_the_recorded_policy_reproduces_every_recorded_pick(tmp_path: Path, policy: str) -> None:
    path = tmp_path / "fleet.ligrec"
    records = write(path, Spec(decisions=600, policy=PolicyConfig(policy), seed=7))
    report = report_of(path, "recorded")
    (recorded,) = report.policies
    assert report.decisions == recorded.decisions == 600
    assert recorded.agree == 600 and recorded.agreement == 1.0
    assert recorded.shed == sum(record.shed for record in records)
    assert recorded.shed_extra == recorded.shed_missed == 0
    assert report.differences == []
    # Every pick, not only the count: the spread per pod is the recorded one.
    picks = Counter(record.pick for record in records if record.pick is not None)
    assert recorded.pools["chat"].picks == {pod: picks.get(pod, 0)
                                             for pod in sorted({f"pod-{i}" for i in range(8)})}


def test_the_recorded_policy_follows_a_registry_change(tmp_path: Path) -> None:
    """From decision 300 on, the pool's registry entry names stricter thresholds: the recorded
    policy takes them from there (100% agreement), a fixed default filter tree only agrees
    before the change."""
    path = tmp_path / "fleet.ligrec"
    records = write(path, Spec(decisions=600, policy=PolicyConfig("filter-tree"),
                               changes={300: STRICT}, seed=3))
    assert sum(record.shed for record in records[300:]) > sum(
        record.shed for record in records[:300])  # the change mattered
    report = report_of(path, "recorded,filter-tree", top=1000)
    recorded, fixed = report.policies
    assert recorded.agree == 600 and recorded.fallbacks == 0
    assert fixed.agree < 600
    assert all(difference.seq >= 300 for difference in report.differences)


def test_a_pool_rewrite_that_keeps_the_policy_keeps_its_state(tmp_path: Path) -> None:
    """A picker rebuilds its policy only when the config changes: round-robin's cursor runs on
    through a rewrite of the pool's key (a selector change), and so must the re-run's."""
    path = tmp_path / "fleet.ligrec"
    config = PolicyConfig("round-robin")
    write(path, Spec(decisions=300, policy=config, changes={101: config, 202: config}, seed=4))
    (recorded,) = report_of(path, "recorded").policies
    assert recorded.agree == 300


def test_another_policy_disagrees_and_the_differences_are_ranked(tmp_path: Path,
                                                                 capsys) -> None:
    path = tmp_path / "fleet.ligrec"
    records = write(path, Spec(decisions=800, policy=PolicyConfig("filter-tree"), seed=11))
    result = replay_json(capsys, str(path), "--policies", "least-queue,recorded", "--top", "7")
    least_queue, recorded = result["policies"]
    assert result["recorded"]["agree"] == recorded["agree"] == 800
    assert 0 < least_queue["agree"] < 800
    assert least_queue["agreement"] == pytest.approx(least_queue["agree"] / 800)
    # least-queue never sheds: every recorded shed is one it missed.
    sheds = sum(record.shed for record in records)
    assert sheds > 0 and least_queue["shed"] == 0 and least_queue["shed_missed"] == sheds
    assert result["recorded"]["shed_by_criticality"] == {"Sheddable": sheds}
    differences = result["differences"]
    assert len(differences) == 7
    keys = [(d["shed_differs"], d["load_gap"]) for d in differences]
    assert keys == sorted(keys, reverse=True)
    assert differences[0]["shed_differs"]  # a recorded shed least-queue would have routed
    by_id = {record.request_id: record for record in records}
    for difference in differences:
        record = by_id[difference["request_id"]]
        labels = [choice["policy"] for choice in difference["choices"]]
        assert labels == ["as recorded", "least-queue", "recorded"]
        assert difference["choices"][0]["pick"] == record.pick
        loads = [c["load"] for c in difference["choices"] if c["load"] is not None]
        assert difference["load_gap"] == max(loads) - min(loads)
    spread = least_queue["pools"]["chat"]
    assert sum(spread["picks"].values()) == least_queue["picks"] == 800
    mean = 800 / 8
    assert spread["max_over_mean"] == pytest.approx(max(spread["picks"].values()) / mean)
    assert sum(spread["share"].values()) == pytest.approx(1.0)


def test_text_report_says_open_loop_and_points_to_the_closed_loop(tmp_path: Path,
                                                                  capsys) -> None:
    path = tmp_path / "fleet.ligrec"
    write(path, Spec(decisions=200, policy=PolicyConfig("prefix-aware")))
    assert main(["replay", str(path), "--what-if", "--policies",
                 'recorded,filter-tree:{"kv_cache_threshold":0.5,"queueing_threshold_lora":9}',
                 "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "open loop" in out and "lig bench --trace-from-recording" in out
    assert "200 decisions" in out
    assert 'filter-tree:{"kv_cache_threshold":0.5,"queueing_threshold_lora":9}' in out
    assert "share of picks per pod, pool chat" in out and "max/mean" in out
    assert out.count(" gap ") == 3
    assert main(["replay", str(path), "--what-if", "--policies", "recorded", "--pool", "x"]) == 0
    out = capsys.readouterr().out
    assert "0 decisions" in out and "no decision records to compare: none in this file for " \
        "pool x" in out


def test_pool_filter_and_undecodable_batches_are_counted_not_fatal(tmp_path: Path,
                                                                   capsys) -> None:
    path = tmp_path / "two.ligrec"
    rng = random.Random(5)
    recorder = Recorder(PolicyConfig("least-queue"))
    with path.open("wb") as out:
        writer = Writer(out, FileHeader(START_NS, START_NS, START_NS + 10, "lig"))
        for index in range(40):
            pool = "chat" if index % 2 else "code"
            record = recorder.decide(random_record(rng, index, START_NS + index, "least-queue",
                                                   random_view(rng, 4)))
            batch = RecordBatch("picker-a", pool, START_NS + index, [record])
            writer.add(Kind.DECISION, Entry(START_NS + index, f"records.{pool}",
                                            msgspec.msgpack.encode(batch)))
        writer.add(Kind.DECISION, Entry(START_NS + 50, "records.chat", b"\xc1 not msgpack"))
        absurd = msgspec.structs.replace(record, prefix_blocks=1 << 40)  # no picker hashes so many
        writer.add(Kind.DECISION, Entry(START_NS + 50, "records.chat", msgspec.msgpack.encode(
            RecordBatch("picker-a", "chat", 0, [absurd]))))
        writer.add(Kind.DECISION, Entry(START_NS + 51, "records.chat", msgspec.msgpack.encode(
            RecordBatch("picker-a", "chat", 0, [], schema=99))))
        writer.close()
    result = replay_json(capsys, str(path), "--policies", "least-queue", "--pool", "chat")
    assert (result["decisions"], result["undecodable"], result["pool"]) == (20, 3, "chat")
    assert set(result["policies"][0]["pools"]) == {"chat"}
    # No pool in the registry: the record's policy with default params, counted.
    assert result["policies"][0]["fallbacks"] == 0  # a named policy is not the recorded one
    everything = report_of(path, "recorded")
    assert everything.decisions == 40 and everything.policies[0].fallbacks == 40
    assert everything.policies[0].agree == 40


def test_a_truncated_file_yields_what_came_before_then_fails(tmp_path: Path) -> None:
    path = tmp_path / "fleet.ligrec"
    write(path, Spec(decisions=3000, policy=PolicyConfig("random"), snapshots_every=1))
    data = path.read_bytes()
    source = io.BytesIO(data[: len(data) // 2])
    read_header(source)
    counts = ReadCounts()
    seen = 0
    with pytest.raises(RecordingError, match="truncated"):
        for _ in read_records(source, Registry(), counts):
            seen += 1
    assert 0 < counts.decisions < 3000 and seen == counts.decisions + counts.outcomes


@pytest.mark.parametrize(("args", "fragment"), [
    (["--what-if", "--policies", "fastest"], "unknown policy 'fastest'"),
    (["--what-if", "--policies", "filter-tree:{nope"], "not JSON"),
    (["--what-if", "--policies", 'filter-tree:{"no_such":1}'], "'no_such'"),
    (["--what-if", "--policies", "random,random"], "given twice"),
    (["--what-if", "--policies", "random,"], "an empty policy"),
    (["--what-if"], "needs --policies"),
    (["--policies", "random"], "--policies needs --what-if"),
    (["--what-if", "--policies", "random", "--top", "-1"], "--top must be >= 0"),
])
def test_bad_flags_exit_2_with_one_line(tmp_path: Path, capsys, args: list[str],
                                        fragment: str) -> None:
    path = tmp_path / "fleet.ligrec"
    write(path, Spec(decisions=10))
    assert main(["replay", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "newer"])
def test_a_bad_file_keeps_the_one_line_error_and_exit_2(tmp_path: Path, capsys,
                                                        damage: str) -> None:
    path = tmp_path / "fleet.ligrec"
    write(path, Spec(decisions=300))
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        del data[len(data) - 40:]
    elif damage == "corrupt":
        data[len(data) // 2] ^= 0xFF
    else:
        data[8:10] = (99).to_bytes(2, "big")
    path.write_bytes(bytes(data))
    assert main(["replay", str(path), "--what-if", "--policies", "recorded"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no partial report
    assert captured.err.count("\n") == 1 and str(path) in captured.err
    expected = {"truncated": "truncated", "corrupt": "corrupt", "newer": "version 99"}[damage]
    assert expected in captured.err


def test_policy_specs_split_outside_json() -> None:
    assert split_specs('recorded, filter-tree:{"a":[1,2],"b":"x,}"},random') == [
        "recorded", 'filter-tree:{"a":[1,2],"b":"x,}"}', "random"]
    specs = parse_policy_specs('recorded,prefix-aware:{"picker":"round_robin"}')
    assert [spec.label for spec in specs] == ["recorded", 'prefix-aware:{"picker":"round_robin"}']
    assert specs[0].config is None
    assert specs[1].config == PolicyConfig("prefix-aware", {"picker": "round_robin"})
    with pytest.raises(PolicyConfigError, match="JSON object"):
        parse_policy_specs("random:[1]")


def test_pool_policies_by_revision_and_time() -> None:
    registry = Registry()
    registry.apply("pool.chat", b"\xc1", 10)
    assert registry.policy("chat") is None  # does not decode: logged, no policy
    registry.apply("pool.chat", encode(InferencePool("chat", 1, policy=PolicyConfig("random"))),
                   20)
    assert registry.policy("chat") == PolicyConfig("random")
    # By time: a record of t=15 decided before the second write (its batch came after it).
    assert registry.policy("chat", 15) is None and registry.policy("chat", 5) is None
    assert registry.policy("chat", 20) == PolicyConfig("random")
    registry.apply("pool.chat", None, 30)
    assert registry.policy("chat") is None and registry.policy("chat", 25) is not None


def test_the_deferred_seed_gives_the_numbers_random_gives() -> None:
    """Any mix of seeds, one-element and longer choices, float and bit draws, shuffles and
    state reads: a DeferredSeedRandom and a random.Random answer alike, step for step."""
    script = random.Random(17)
    deferred, plain = DeferredSeedRandom(), random.Random()
    deferred.seed(1)
    plain.seed(1)
    for step in range(20_000):
        op = script.randrange(8)
        if op in (0, 1):
            draw = script.getrandbits(64)
            deferred.seed(draw)
            plain.seed(draw)
            continue
        if op in (2, 3):
            items = list(range(script.choice((1, 1, 1, 2, 3, 7))))
            answers = deferred.choice(items), plain.choice(items)
        elif op == 4:
            answers = deferred.random(), plain.random()
        elif op == 5:
            bits = script.randint(1, 70)
            answers = deferred.getrandbits(bits), plain.getrandbits(bits)
        elif op == 6:
            first, second = list(range(6)), list(range(6))
            deferred.shuffle(first)
            plain.shuffle(second)
            answers = first, second
        else:
            answers = deferred.getstate(), plain.getstate()
        assert answers[0] == answers[1], step
    # A state restored drops a deferred seed.
    deferred.seed(5)
    deferred.setstate(plain.getstate())
    assert deferred.random() == plain.random()


def test_the_top_list_is_the_head_of_the_full_ranking(tmp_path: Path) -> None:
    """The bounded heap keeps exactly what ranking every differing decision would put first:
    shed differences, then the largest load gap, then the earliest."""
    path = tmp_path / "fleet.ligrec"
    write(path, Spec(decisions=1500, policy=PolicyConfig("filter-tree"), seed=8))
    everything = report_of(path, "least-queue,random", top=100_000).differences
    assert len(everything) > 100
    ranked = sorted(everything, key=lambda d: (-d.shed_differs, -d.load_gap, d.time_ns))
    assert [d.seq for d in everything] == [d.seq for d in ranked]
    for top in (1, 5, 40):
        assert [d.seq for d in report_of(path, "least-queue,random", top=top).differences] == [
            d.seq for d in ranked[:top]]
