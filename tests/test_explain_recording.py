"""``lig explain --recording FILE --request-id ID``: a recorded decision (made by a real policy
under the draw contract) explained as ``lig explain`` explains the same pods and request with
the same seed, plus the recorded pick, the agreement and the outcome; and its errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec
import pytest

from lig.cli import main
from recording.fileformat import Entry, FileHeader, Kind, Writer
from scheduling.record import DecisionRecord, OutcomeRecord, RecordBatch, recorded_request_id
from shared.schemas import PolicyConfig
from tests.support.recorded_decisions import (
    START_NS,
    Recorder,
    Spec,
    random_record,
    random_view,
    write,
)


def explain(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["explain", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def as_files(tmp_path: Path, record: DecisionRecord) -> list[str]:
    """``lig explain --pods/--request`` inputs holding the record's view and request."""
    pods = [{"name": view.name, "address": view.address, "waiting": view.waiting,
             "running": view.running, "kv_cache_usage": view.kv_cache_usage,
             "running_adapters": sorted(view.running_adapters),
             "waiting_adapters": sorted(view.waiting_adapters), "max_lora": view.max_lora,
             "in_flight": view.in_flight, "unreported_tokens": view.unreported_tokens}
            for view in record.view]
    request = {"model": record.model, "target_model": record.target_model,
               "criticality": record.criticality.value, "prompt_tokens": record.prompt_tokens,
               "max_tokens": record.max_tokens, "prefix_blocks": record.prefix_blocks,
               "prefix_hits": record.prefix_hits}
    (tmp_path / "pods.json").write_text(json.dumps(pods))
    (tmp_path / "request.json").write_text(json.dumps(request))
    return ["--pods", str(tmp_path / "pods.json"), "--request", str(tmp_path / "request.json"),
            "--policy", record.policy, "--seed", str(record.draw)]


@pytest.mark.parametrize("policy", ["prefix-aware", "filter-tree"])
def test_a_recorded_decision_is_explained_as_lig_explain_explains_it(
        tmp_path: Path, capsys, policy: str) -> None:
    path = tmp_path / "fleet.ligrec"
    records = write(path, Spec(decisions=400, policy=PolicyConfig(policy), seed=21))
    record = next(r for r in records[200:] if r.pick is not None)
    code, out, err = explain(capsys, "--recording", str(path), "--request-id", record.request_id)
    assert (code, err) == (0, "")
    code, direct, _ = explain(capsys, *as_files(tmp_path, record))
    assert code == 0
    lines = out.rstrip("\n").split("\n")
    assert "\n".join(lines[:-2]) == direct.rstrip("\n")  # exactly lig explain's output
    address = next(view.address for view in record.view if view.name == record.pick)
    assert lines[-3] == f"pick: {record.pick} ({address})"
    picker = f"picker-{'ab'[record.seq % 2]}"  # the pickers take turns
    assert lines[-2].startswith("recorded: ") and f"by {picker}, pool chat" in lines[-2]
    assert f"pick {record.pick}; the re-run agrees" in lines[-2]
    assert lines[-1] == (f"outcome: served by {record.pick}, status 200, first byte 12.5 ms, "
                         "done after 80.0 ms, 10 prompt + 20 completion tokens")


def test_json_holds_lig_explains_object_and_the_recorded_fields(tmp_path: Path,
                                                                capsys) -> None:
    path = tmp_path / "fleet.ligrec"
    records = write(path, Spec(decisions=300, policy=PolicyConfig("filter-tree"), seed=5))
    record = next(r for r in records if r.shed)
    code, out, _ = explain(capsys, "--recording", str(path), "--request-id", record.request_id,
                           "--json")
    assert code == 0 and out.count("\n") == 1
    result = json.loads(out)
    (decision,) = result["decisions"]
    code, direct, _ = explain(capsys, *as_files(tmp_path, record), "--json")
    assert decision["explain"] == json.loads(direct)
    assert decision["explain"]["shed"] and decision["recorded_shed"] and decision["agrees"]
    assert (decision["recorded_pick"], decision["outcome"]) == (None, None)  # shed: no outcome
    assert decision["policy"] == {"name": "filter-tree", "params": {}}
    assert (decision["seq"], decision["pool"], result["request_id"]) == (
        record.seq, "chat", record.request_id)


def test_every_picker_that_recorded_the_request_is_shown(tmp_path: Path, capsys) -> None:
    """A retry through another picker: two records with one request id. The second picker's
    record is tampered with (another pick than its draw gives): the re-run says so."""
    rng = random.Random(9)
    path = tmp_path / "retry.ligrec"
    first = Recorder(PolicyConfig("least-queue")).decide(
        random_record(rng, 1, START_NS + 1, "least-queue", random_view(rng, 6)))
    second = Recorder(PolicyConfig("least-queue")).decide(
        random_record(rng, 1, START_NS + 2, "least-queue", random_view(rng, 6)))
    drawn = second.pick
    other = next(view.name for view in second.view if view.name != drawn)
    second = msgspec.structs.replace(second, pick=other)
    with path.open("wb") as out:
        writer = Writer(out, FileHeader(START_NS, START_NS, START_NS + 10, "lig"))
        for time_ns, picker, record in ((1, "picker-a", first), (2, "picker-b", second)):
            batch = RecordBatch(picker, "chat", START_NS + time_ns, [record])
            writer.add(Kind.DECISION, Entry(START_NS + time_ns, "records.chat",
                                            msgspec.msgpack.encode(batch)))
        outcome = OutcomeRecord("req-1", 1, other, 503, None, 4.0)
        writer.add(Kind.DECISION, Entry(START_NS + 3, "records.chat", msgspec.msgpack.encode(
            RecordBatch("picker-b", "chat", START_NS + 3, [outcome]))))
        writer.close()
    code, out, _ = explain(capsys, "--recording", str(path), "--request-id", "req-1")
    assert code == 0
    first_text, second_text = out.split("\n\n")
    assert "by picker-a" in first_text and "the re-run agrees" in first_text
    assert "outcome:" not in first_text
    assert f"pick {other}; the re-run DISAGREES (it chose {drawn})" in second_text
    assert second_text.rstrip().endswith(
        f"outcome: served by {other}, status 503, first byte no body, done after 4.0 ms, "
        "usage not reported")


@pytest.mark.parametrize(("cached", "predicted", "shown"), [
    (480, 512, ", 480 cached (predicted 512)"),
    (None, 512, ", cached tokens not reported (predicted 512)"),
    (None, None, "")],  # recorded before the fields
    ids=["reported", "not-reported", "older-recording"])
def test_the_outcome_line_compares_cached_tokens_with_the_prediction(
        tmp_path: Path, capsys, cached: int | None, predicted: int | None, shown: str) -> None:
    path = tmp_path / "reuse.ligrec"
    record = Recorder(PolicyConfig("least-queue")).decide(
        random_record(random.Random(4), 1, START_NS + 1, "least-queue",
                      random_view(random.Random(4), 3)))
    outcome = OutcomeRecord("req-1", 1, str(record.pick), 200, 3.0, 9.0, 600, 4, cached,
                            predicted)
    with path.open("wb") as out:
        writer = Writer(out, FileHeader(START_NS, START_NS, START_NS + 10, "lig"))
        for time_ns, entry in ((1, record), (2, outcome)):
            batch = RecordBatch("picker-a", "chat", START_NS + time_ns, [entry])
            writer.add(Kind.DECISION, Entry(START_NS + time_ns, "records.chat",
                                            msgspec.msgpack.encode(batch)))
        writer.close()
    code, out, _ = explain(capsys, "--recording", str(path), "--request-id", "req-1")
    assert code == 0
    assert out.rstrip("\n").split("\n")[-1].endswith(
        f"600 prompt + 4 completion tokens{shown}")
    code, out, _ = explain(capsys, "--recording", str(path), "--request-id", "req-1", "--json")
    (decision,) = json.loads(out)["decisions"]
    assert (decision["outcome"]["cached_tokens"],
            decision["outcome"]["predicted_cached_tokens"]) == (cached, predicted)


def test_an_unknown_request_id_is_one_line_and_exit_1(tmp_path: Path, capsys) -> None:
    path = tmp_path / "fleet.ligrec"
    write(path, Spec(decisions=50))
    code, out, err = explain(capsys, "--recording", str(path), "--request-id", "req-nope")
    assert (code, out) == (1, "")
    assert err == f"lig explain: error: no decision with request id 'req-nope' in {path} " \
                  "(50 decisions read)\n"


@pytest.mark.parametrize(("args", "fragment"), [
    (["--recording", "{file}"], "--recording and --request-id go together"),
    (["--request-id", "req-1"], "--recording and --request-id go together"),
    (["--recording", "{file}", "--request-id", "req-1", "--policy", "random"],
     "--policy cannot be combined with --recording"),
    (["--recording", "{file}", "--request-id", "req-1", "--seed", "3"],
     "--seed cannot be combined with --recording"),
    ([], "--pods and --request are required"),
    (["--recording", "{missing}", "--request-id", "req-1"], "cannot read"),
    (["--recording", "{garbage}", "--request-id", "req-1"], "not a lig recording"),
    (["--recording", "{truncated}", "--request-id", "req-1"], "truncated recording"),
])
def test_bad_flags_and_files_exit_2_with_one_line(tmp_path: Path, capsys, args: list[str],
                                                  fragment: str) -> None:
    path = tmp_path / "fleet.ligrec"
    write(path, Spec(decisions=200))
    (tmp_path / "garbage").write_bytes(b"hello, world\n")
    (tmp_path / "truncated").write_bytes(path.read_bytes()[:-30])
    names = {"file": path, "missing": tmp_path / "missing", "garbage": tmp_path / "garbage",
             "truncated": tmp_path / "truncated"}
    code, out, err = explain(capsys, *[arg.format(**names) for arg in args])
    assert (code, out) == (2, "")
    assert fragment in err and err.count("\n") == 1


def test_a_record_that_does_not_decode_is_skipped_and_counted(tmp_path: Path, capsys) -> None:
    """Records are decoded as far as their request id first: a broken one among good ones
    costs only itself."""
    path = tmp_path / "fleet.ligrec"
    rng = random.Random(2)
    good = Recorder(PolicyConfig("random")).decide(
        random_record(rng, 7, START_NS + 1, "random", random_view(rng, 3)))
    broken = {"picker": "picker-a", "pool": "chat", "sent_at_ns": 0,
              "records": [["d", "req-broken", "not a seq"], good]}
    with path.open("wb") as out:
        writer = Writer(out, FileHeader(START_NS, START_NS, START_NS + 10, "lig"))
        writer.add(Kind.DECISION, Entry(START_NS + 1, "records.chat",
                                        msgspec.msgpack.encode(broken)))
        writer.close()
    code, out, _ = explain(capsys, "--recording", str(path), "--request-id", "req-7")
    assert code == 0 and f"pick {good.pick}; the re-run agrees" in out
    code, out, err = explain(capsys, "--recording", str(path), "--request-id", "req-broken")
    assert (code, out) == (1, "")
    assert "(2 decisions read, 1 undecodable records or batches skipped)" in err


@pytest.mark.parametrize("sent", ["\u00e9" * 150 + "-tail", "x" * 199 + "\u00e9"],
                         ids=["longer than kept", "cut inside a character"])
def test_an_id_longer_than_records_keep_still_finds_its_decision(
        tmp_path: Path, capsys, sent: str) -> None:
    """The picker keeps an x-request-id's first 200 bytes (scheduling.record.
    recorded_request_id); the id the client sent, quoted whole, finds its record."""
    kept = recorded_request_id(sent.encode())
    assert kept != sent
    record = Recorder(PolicyConfig("random")).decide(msgspec.structs.replace(
        random_record(random.Random(3), 0, START_NS, "random",
                      random_view(random.Random(4), 3)), request_id=kept))
    path = tmp_path / "one.ligrec"
    with path.open("wb") as out:
        writer = Writer(out, FileHeader(created_ns=START_NS, from_ns=START_NS,
                                        to_ns=START_NS + 1, prefix="lig", pool=None,
                                        source="test"))
        writer.add(Kind.DECISION, Entry(START_NS, "records.chat", msgspec.msgpack.encode(
            RecordBatch(picker="p", pool="chat", sent_at_ns=START_NS, records=[record]))))
        writer.close()
    code, out, err = explain(capsys, "--recording", str(path), "--request-id", sent)
    assert (code, err) == (0, "")
    assert f"pick: {record.pick}" in out
