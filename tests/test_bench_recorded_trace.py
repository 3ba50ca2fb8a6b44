"""``lig bench --trace-from-recording``: a flight recording's arrivals as a benchmark workload.

The recording is written with the recording writer (``recording.fileformat.Writer``) from
hand-built decision and outcome records: two pickers whose decision numbers overlap, outcomes
with and without usage, a LoRA target, a second pool, the decision stream beside the records
and one record batch that does not decode.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from lig.cli import main
from recording.fileformat import Entry, FileHeader, Kind, Writer
from scheduling.record import DecisionRecord, OutcomeRecord, RecordBatch
from scheduling.types import PodView
from scheduling_bench.recorded_trace import DEFAULT_OUTPUT_TOKENS, read_recorded_trace
from scheduling_bench.results import RunMetrics
from scheduling_bench.workloads import BASE_MODEL, Workload, generate
from shared.schemas import Criticality, Endpoint, EndpointSet, InferencePool, encode

START_NS = 1_790_000_000_000_000_000
BASE = "meta-llama/Llama-3.1-8B-Instruct-prod"  # the recorded base model: not the bench's name
CRITICALITIES = (Criticality.STANDARD, Criticality.CRITICAL, Criticality.SHEDDABLE)


class Planned(msgspec.Struct, frozen=True):
    """One recorded request and what the trace must make of it."""

    offset_ms: int
    picker: str
    seq: int
    target: str
    criticality: Criticality
    estimate: int
    max_tokens: int
    usage: tuple[int, int] | None  # (prompt, completion) in the outcome; None: no usage
    outcome: bool = True
    prefix_hit: bool = False

    @property
    def prompt(self) -> int:
        return self.usage[0] if self.usage else self.estimate

    @property
    def output(self) -> int:
        if self.usage:
            return self.usage[1]
        return self.max_tokens or DEFAULT_OUTPUT_TOKENS


def _planned() -> list[Planned]:
    """Twelve requests over 1.1 s from two pickers with the same decision numbers."""
    plan = []
    for index in range(12):
        picker, seq = ("picker-a", index // 2) if index % 2 == 0 else ("picker-b", index // 2)
        target = {3: "sql-lora", 7: "sql-lora", 10: "sql-lora", 5: "tweet-summary-1"}.get(
            index, BASE)
        usage = (300 + 10 * index, 20 + index) if index % 3 == 0 else None
        plan.append(Planned(
            offset_ms=100 * index + (7 if index % 4 == 1 else 0),
            picker=picker, seq=seq, target=target, criticality=CRITICALITIES[index % 3],
            estimate=200 + 5 * index, max_tokens=0 if index in (4, 8) else 30 + index,
            usage=usage, outcome=index not in (4, 11), prefix_hit=index in (2, 9)))
    return plan


def _views() -> tuple[PodView, ...]:
    return (
        PodView("vllm-0", "10.0.0.1:8000", waiting=1, running=3, kv_cache_usage=0.2,
                running_adapters=frozenset({"sql-lora"}), max_lora=2),
        PodView("vllm-1", "10.0.0.2:8000", running=1,
                waiting_adapters=frozenset({"tweet-summary-1"}), max_lora=2),
        PodView("vllm-2", "10.0.0.3:8000"),
    )


def _decision(request: Planned, pool: str = "chat") -> DecisionRecord:
    return DecisionRecord(
        request_id=f"req-{request.picker}-{request.seq}", seq=request.seq,
        time_ns=START_NS + request.offset_ms * 1_000_000, model=request.target,
        target_model=request.target, criticality=request.criticality,
        prompt_tokens=request.estimate, max_tokens=request.max_tokens, prefix_blocks=3,
        prefix_hits={"vllm-0": 2} if request.prefix_hit else {}, policy="least-queue",
        draw=123456789, view=_views(), pick="vllm-0" if pool == "chat" else None,
        shed=pool != "chat")


def _outcome(request: Planned) -> OutcomeRecord:
    prompt, completion = request.usage or (None, None)
    return OutcomeRecord(request_id=f"req-{request.picker}-{request.seq}", seq=request.seq,
                         served="vllm-0", status=200, ttfb_ms=12.0, duration_ms=800.0,
                         prompt_tokens=prompt, completion_tokens=completion)


def _endpoints(pool: str, count: int) -> bytes:
    return encode(EndpointSet(pool, tuple(
        Endpoint(f"vllm-{pod}", f"10.0.0.{pod + 1}", 8000) for pod in range(count))))


def write_recording(path: Path, plan: list[Planned]) -> None:
    """A recording of pool ``chat`` (``plan``, 3 then 4 endpoints) and pool ``batch``."""
    with path.open("wb") as out:
        writer = Writer(out, FileHeader(created_ns=START_NS + 10**10, from_ns=START_NS - 10**9,
                                        to_ns=START_NS + 5 * 10**9, prefix="lig"))
        before = START_NS - 10**9
        writer.add(Kind.REGISTRY_STATE, Entry(before, "pool.chat", encode(
            InferencePool(name="chat", target_port=8000))))
        writer.add(Kind.REGISTRY_STATE, Entry(before, "endpoints.chat", _endpoints("chat", 3)))
        writer.add(Kind.REGISTRY_STATE, Entry(before, "endpoints.batch", _endpoints("batch", 2)))
        writer.add(Kind.REGISTRY_CHANGE, Entry(START_NS, "endpoints.chat", _endpoints("chat", 4)))
        writer.add(Kind.DECISION, Entry(START_NS, "records.chat", b"\xc1not a batch"))
        writer.add(Kind.DECISION, Entry(START_NS, "decisions.chat", b"\x93opaque stream"))
        for pool, requests in (("chat", plan), ("batch", plan[:2])):
            for request in requests:
                time_ns = START_NS + request.offset_ms * 1_000_000
                batch = RecordBatch(picker=request.picker, pool=pool, sent_at_ns=time_ns,
                                    records=[_decision(request, pool)])
                writer.add(Kind.DECISION, Entry(time_ns, f"records.{pool}", encode(batch)))
        for request in plan:  # outcomes in later batches, after every decision
            if request.outcome:
                batch = RecordBatch(picker=request.picker, pool="chat", sent_at_ns=START_NS,
                                    records=[_outcome(request)])
                writer.add(Kind.DECISION, Entry(START_NS + 2 * 10**9, "records.chat",
                                                encode(batch)))
        writer.close()


def _expected(request: Planned) -> tuple[int, int]:
    if request.outcome:
        return request.prompt, request.output
    return request.estimate, request.max_tokens or DEFAULT_OUTPUT_TOKENS


@pytest.fixture
def recording(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.ligrec"
    write_recording(path, _planned())
    return path


def test_the_trace_holds_every_recorded_arrival(recording: Path) -> None:
    plan = _planned()
    trace = read_recorded_trace(recording, "chat")
    assert [arrival.time for arrival in trace.arrivals] == pytest.approx(
        [request.offset_ms / 1000 for request in plan])
    assert [arrival.target_model for arrival in trace.arrivals] == [r.target for r in plan]
    assert [arrival.criticality for arrival in trace.arrivals] == [r.criticality for r in plan]
    assert [(arrival.prompt_tokens, arrival.output_tokens) for arrival in trace.arrivals] == [
        _expected(request) for request in plan]
    assert trace.endpoints == 4 and trace.view_pods == 3 and trace.max_lora == 2
    assert trace.pickers == 2
    assert trace.adapters == ("sql-lora", "tweet-summary-1")  # most requested first
    assert trace.prefix_hit_decisions == 2 and trace.skipped == 1
    assert trace.first_skip.startswith("a record batch on records.chat does not decode")
    assert trace.rate == pytest.approx(11 / 1.1)
    sources = trace.sources
    assert (sources.prompt_usage, sources.prompt_estimate) == (4, 8)
    assert (sources.output_usage, sources.output_max_tokens, sources.output_default) == (4, 6, 2)


def test_the_workload_plays_the_arrivals_at_the_recorded_or_a_scaled_rate(
    recording: Path,
) -> None:
    plan = _planned()
    trace = read_recorded_trace(recording, "chat")
    workload = Workload(name="recording", recording=str(recording), recording_pool="chat",
                        adapters=2)
    for speed in (1.0, 2.0):
        rate = trace.rate * speed
        requests = generate(workload, rate, len(plan) / rate, seed=1)
        assert [request.time for request in requests] == pytest.approx(
            [request.offset_ms / 1000 / speed for request in plan])
        assert [(request.spec.prompt.length, request.spec.max_tokens) for request in requests] \
            == [_expected(request) for request in plan]
        simulated = {BASE: BASE_MODEL, "sql-lora": "adapter-0", "tweet-summary-1": "adapter-1"}
        assert [request.model for request in requests] == [simulated[r.target] for r in plan]
        assert [request.criticality for request in requests] == [r.criticality for r in plan]
    # --duration cuts the trace: only the arrivals before it play.
    assert len(generate(workload, trace.rate, 0.5, seed=1)) == 5


def test_bench_runs_the_recorded_arrivals_and_reports_as_usual(
    recording: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = _planned()
    out = tmp_path / "out"
    code = main(["bench", "--trace-from-recording", str(recording), "--pool", "chat",
                 "--policies", "round-robin,least-queue", "--jobs", "1", "--no-plots",
                 "--out", str(out)])
    assert code == 0
    results = msgspec.json.decode((out / "results.json").read_bytes(), type=list[RunMetrics])
    assert [result.policy for result in results] == ["round-robin", "least-queue"]
    expected = [_expected(request) for request in plan]
    for result in results:
        assert result.workload == "recording" and result.pods == 4  # the recorded endpoints
        assert result.rate == pytest.approx(11 / 1.1)
        assert result.requests == result.completed == len(plan)
        assert result.prompt_tokens == sum(prompt for prompt, _ in expected)
        assert result.output_tokens == sum(output for _, output in expected)
        assert result.adapter_loads >= 1  # the LoRA targets ran as adapters
        for criticality in CRITICALITIES:
            assert result.by_criticality[str(criticality)].requests == sum(
                1 for request in plan if request.criticality is criticality)
    table = (out / "results.md").read_text()
    assert table in capsys.readouterr().out
    assert "12 arrivals over 1.100 s (10 req/s recorded) by 2 picker(s)" in table
    assert "| round-robin |" in table
    assert "2 of 12 recorded decisions had prefix-cache hits" in table
    assert "Skipped 1 undecodable message(s); first: a record batch on records.chat" in table


def test_flags_override_what_the_recording_implies(recording: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = main(["bench", "--trace-from-recording", str(recording), "--pool", "chat",
                 "--policies", "least-queue", "--pods", "2", "--rates", "40", "--jobs", "1",
                 "--no-plots", "--out", str(out)])
    assert code == 0
    (result,) = msgspec.json.decode((out / "results.json").read_bytes(), type=list[RunMetrics])
    assert (result.pods, result.rate, result.requests) == (2, 40, 12)
    assert result.duration == pytest.approx(12 / 40)


def _bad_files(tmp_path: Path, recording: Path) -> dict[str, Path]:
    whole = recording.read_bytes()
    truncated = tmp_path / "truncated.ligrec"
    truncated.write_bytes(whole[: len(whole) // 2])
    text = tmp_path / "notes.txt"
    text.write_text("arrived_at,num_prefill_tokens\n")
    single = tmp_path / "single.ligrec"
    write_recording(single, _planned()[:1])
    return {"truncated": truncated, "text": text, "single": single,
            "missing": tmp_path / "nothing.ligrec", "good": recording}


@pytest.mark.parametrize(
    ("file", "flags", "message"),
    [
        ("truncated", ["--pool", "chat"], "truncated recording"),
        ("text", [], "not a lig recording"),
        ("missing", [], "No such file"),
        ("single", ["--pool", "chat"], "at least two arrivals"),
        ("good", [], "records of several pools (batch, chat): pass --pool"),
        ("good", ["--pool", "web"], "no decision records of pool 'web'"),
        ("good", ["--pool", "chat", "--workload", "chat"], "--workload cannot apply"),
        ("good", ["--pool", "chat", "--adapters", "3"], "--adapters cannot apply"),
        ("good", ["--pool", "chat", "--duration", "0"], "--duration > 0"),
    ],
)
def test_a_bad_recording_or_flag_exits_2_with_one_line(
    recording: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], file: str,
    flags: list[str], message: str,
) -> None:
    path = _bad_files(tmp_path, recording)[file]
    code = main(["bench", "--trace-from-recording", str(path), *flags, "--jobs", "1",
                 "--no-plots", "--out", str(tmp_path / "out")])
    assert code == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1, error
    assert not (tmp_path / "out").exists()


def test_pool_without_a_recording_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--pool", "chat", "--no-plots", "--out", str(tmp_path)]) == 2
    assert "use it with --trace-from-recording" in capsys.readouterr().err


def test_the_command_line_gives_one_line_for_a_corrupt_file(
    recording: Path, tmp_path: Path
) -> None:
    corrupt = tmp_path / "corrupt.ligrec"
    whole = bytearray(recording.read_bytes())
    whole[len(whole) // 2] ^= 0xFF  # inside the compressed body
    corrupt.write_bytes(bytes(whole))
    result = subprocess.run(
        [sys.executable, "-m", "lig.cli", "bench", "--trace-from-recording", str(corrupt),
         "--pool", "chat", "--no-plots", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("lig bench: ") and result.stderr.count("\n") == 1, (
        result.stderr)
    assert "corrupt recording" in result.stderr or "truncated recording" in result.stderr


def test_records_no_picker_writes_are_skipped_as_the_replay_reader_skips_them(
    tmp_path: Path,
) -> None:
    """The trace reads with ``recording.records`` (as ``lig replay --what-if`` does): a
    decision record with a prefix-block count no picker records is skipped and counted, not
    played, and an endpoint set that does not decode counts as a skip too."""
    plan = _planned()[:3]
    path = tmp_path / "garbage.ligrec"
    with path.open("wb") as out:
        writer = Writer(out, FileHeader(created_ns=START_NS + 10**10, from_ns=START_NS,
                                        to_ns=START_NS + 10**9, prefix="lig"))
        writer.add(Kind.REGISTRY_STATE, Entry(START_NS, "endpoints.chat", b"\xc1no set"))
        for index, request in enumerate(plan):
            record = _decision(request)
            if index == 1:
                record = msgspec.structs.replace(record, prefix_blocks=-1)
            batch = RecordBatch(picker=request.picker, pool="chat", sent_at_ns=record.time_ns,
                                records=[record])
            writer.add(Kind.DECISION, Entry(record.time_ns, "records.chat", encode(batch)))
        writer.close()
    trace = read_recorded_trace(path)
    assert [arrival.time for arrival in trace.arrivals] == pytest.approx(
        [plan[0].offset_ms / 1000, (plan[2].offset_ms - plan[0].offset_ms) / 1000])
    assert trace.skipped == 2 and trace.endpoints == 0
    assert trace.first_skip.startswith("registry key endpoints.chat does not decode")
