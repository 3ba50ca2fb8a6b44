"""bench/bench_recording.py's flight-record traffic is what it claims to be: RecordBatch messages
of decisions the default policy made on 8-pod views (re-deciding under the draw contract gives
the same pick), an outcome per routed request; and its file is a recording that
``lig bench --trace-from-recording`` plays."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec

from bench.bench_recording import RECORD_PODS, recorded_traffic, write_recording
from lig.cli import main
from scheduling import SchedulingRequest, build_policy
from scheduling.record import DecisionRecord, OutcomeRecord, RecordBatch
from scheduling_bench.recorded_trace import read_recorded_trace
from scheduling_bench.results import RunMetrics
from shared.schemas import PolicyConfig, decode

DECISIONS = 300


def test_the_traffic_is_real_policy_output_in_record_batches(tmp_path: Path) -> None:
    traffic = recorded_traffic(DECISIONS, 1000.0)
    records = [record for _, data in traffic.batches
               for record in decode(data, RecordBatch).records]
    decisions = [record for record in records if isinstance(record, DecisionRecord)]
    outcomes = [record for record in records if isinstance(record, OutcomeRecord)]
    assert [record.seq for record in decisions] == list(range(DECISIONS))
    assert len(outcomes) == traffic.outcomes == sum(1 for r in decisions if r.pick is not None)
    assert traffic.sheds == sum(1 for record in decisions if record.shed)
    assert all(len(record.view) == RECORD_PODS for record in decisions)
    assert sum(len(msgspec.msgpack.encode(record)) for record in decisions) == (
        traffic.decision_bytes)
    rng = random.Random()
    policy = build_policy(PolicyConfig(), rng)
    for record in decisions:  # the draw contract: the recorded draw gives the recorded pick
        rng.seed(record.draw)
        decision = policy.schedule(SchedulingRequest(
            model=record.model, target_model=record.target_model,
            criticality=record.criticality, prompt_tokens=record.prompt_tokens,
            max_tokens=record.max_tokens, prefix_hashes=tuple(range(record.prefix_blocks)),
            prefix_hits=record.prefix_hits), record.view)
        assert (decision.pick.name if decision.pick else None, decision.shed) == (
            record.pick, record.shed)

    path = tmp_path / "traffic.ligrec"
    with path.open("wb") as out:
        write_recording(out, traffic.snapshots, traffic.batches)
    trace = read_recorded_trace(path)
    assert len(trace.arrivals) == DECISIONS and trace.pods == RECORD_PODS
    assert trace.sources.prompt_usage == traffic.outcomes
    code = main(["bench", "--trace-from-recording", str(path), "--policies", "least-queue",
                 "--jobs", "1", "--no-plots", "--out", str(tmp_path / "out")])
    assert code == 0
    (result,) = msgspec.json.decode((tmp_path / "out" / "results.json").read_bytes(),
                                    type=list[RunMetrics])
    assert result.requests == DECISIONS and result.pods == RECORD_PODS
