"""Workload generators of ``lig bench``: seeded, shaped as documented, and trace replay."""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from scheduling_bench.workloads import (
    BASE_MODEL,
    WORKLOADS,
    TraceError,
    generate,
    read_trace,
)
from shared.schemas import Criticality

CHAT = WORKLOADS["chat"]


def lengths(requests) -> tuple[list[int], list[int]]:
    return [r.spec.prompt.length for r in requests], [r.spec.max_tokens for r in requests]


def test_same_seed_same_requests_other_seed_others() -> None:
    first = generate(WORKLOADS["multi-lora"], 50, 20, seed=3)
    assert generate(WORKLOADS["multi-lora"], 50, 20, seed=3) == first
    assert generate(WORKLOADS["multi-lora"], 50, 20, seed=4) != first


def test_chat_rate_and_lengths_match_the_azure_conversation_fit() -> None:
    requests = generate(CHAT, 200, 50, seed=1)
    assert 0.95 * 10_000 < len(requests) < 1.05 * 10_000
    times = [r.time for r in requests]
    assert times == sorted(times) and times[0] > 0 and times[-1] < 50
    prompts, outputs = lengths(requests)
    assert 950 < statistics.median(prompts) < 1090
    assert 1080 < statistics.mean(prompts) < 1230  # the trace's mean is 1155
    assert 120 < statistics.median(outputs) < 138
    assert max(outputs) <= 1000 and min(outputs) >= 1
    assert {r.model for r in requests} == {BASE_MODEL}
    assert {r.criticality for r in requests} == {Criticality.STANDARD}
    assert all(r.spec.adapter is None for r in requests)


def test_request_contents_do_not_depend_on_the_rate() -> None:
    slow, fast = generate(CHAT, 20, 30, seed=1), generate(CHAT, 80, 30, seed=1)
    assert len(fast) > 3 * len(slow)
    assert [r.spec for r in fast[: len(slow)]] == [r.spec for r in slow]


def test_burstiness_is_the_gamma_shape_of_gaps() -> None:
    def gap_cv(burstiness: float) -> float:
        workload = msgspec.structs.replace(CHAT, burstiness=burstiness)
        times = [r.time for r in generate(workload, 100, 100, seed=2)]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        return statistics.pstdev(gaps) / statistics.mean(gaps)

    assert 0.9 < gap_cv(1.0) < 1.1  # Poisson
    assert 1.8 < gap_cv(0.25) < 2.2  # CV of Gamma(k) gaps is 1/sqrt(k)


def test_multi_lora_zipf_popularity() -> None:
    workload = WORKLOADS["multi-lora"]
    requests = generate(workload, 200, 40, seed=1)
    counts = Counter(r.spec.adapter for r in requests)
    assert set(counts) == {f"adapter-{k}" for k in range(workload.adapters)}
    harmonic = sum(1 / (k + 1) for k in range(workload.adapters))
    assert counts["adapter-0"] / len(requests) == pytest.approx(1 / harmonic, abs=0.02)
    assert counts["adapter-0"] > 1.6 * counts["adapter-1"] > 1.6 * counts["adapter-3"]
    assert all(r.model == r.spec.adapter for r in requests)
    assert workload.max_loras < workload.adapters


def test_shared_prefix_groups_prepend_one_system_prompt_per_group() -> None:
    workload = WORKLOADS["shared-prefix"]
    requests = generate(workload, 100, 20, seed=1)
    prefixes = Counter(r.spec.prompt.segments[0] for r in requests)
    assert len(prefixes) == workload.prefix_groups
    assert {length for _, length in prefixes} == {workload.prefix_tokens}
    own = [r.spec.prompt.segments[1][0] for r in requests]
    assert len(set(own)) == len(requests)  # the rest of every prompt is its own


def test_mixed_criticality_fractions() -> None:
    requests = generate(WORKLOADS["mixed-criticality"], 200, 30, seed=1)
    shares = Counter(r.criticality for r in requests)
    assert shares[Criticality.CRITICAL] / len(requests) == pytest.approx(0.2, abs=0.02)
    assert shares[Criticality.SHEDDABLE] / len(requests) == pytest.approx(0.3, abs=0.02)
    assert shares[Criticality.STANDARD] / len(requests) == pytest.approx(0.5, abs=0.02)


def test_invalid_workload_is_refused() -> None:
    with pytest.raises(ValueError, match="add up to at most 1"):
        generate(msgspec.structs.replace(CHAT, sheddable_fraction=0.8, critical_fraction=0.3),
                 10, 10, seed=1)
    with pytest.raises(ValueError, match="prefix_groups and prefix_tokens"):
        generate(msgspec.structs.replace(CHAT, prefix_groups=4), 10, 10, seed=1)


def write_trace(path: Path) -> Path:
    # 5 requests over 8 s (0.5 req/s), unsorted, times not starting at 0.
    path.write_text(
        "arrived_at,num_prefill_tokens,num_decode_tokens\n"
        "12.0,300,30\n"
        "10.0,100,10\n"
        "14.0,500,50\n"
        "16.0,0,60\n"
        "18.0,200,20000\n"
    )
    return path


def test_trace_replay_rescales_time_and_keeps_lengths(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "trace.csv")
    rows = read_trace(trace)
    assert [row.arrived_at for row in rows] == [0.0, 2.0, 4.0, 6.0, 8.0]
    workload = msgspec.structs.replace(WORKLOADS["trace"], trace=str(trace))
    # 0.5 req/s in the trace, replayed at 5 req/s: ten times faster.
    requests = generate(workload, 5, 2.0, seed=1)
    assert [r.time for r in requests] == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.2,
                                                        1.4, 1.6, 1.8])
    prompts, outputs = lengths(requests)
    # Looped after the last row; a 0-token prompt becomes 1; outputs capped at max_output.
    assert prompts == [100, 300, 500, 1, 200] * 2
    assert outputs == [10, 30, 50, 60, 1000] * 2


def test_trace_replay_reads_the_raw_azure_columns(tmp_path: Path) -> None:
    trace = tmp_path / "azure.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
    )
    rows = read_trace(trace)
    assert rows[1].arrived_at == pytest.approx(4.314579, abs=1e-6)
    assert (rows[1].prompt_tokens, rows[1].output_tokens) == (396, 109)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("time,prompt\n1,2\n", "expected columns arrived_at"),
        ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\nsoon,1,1\n", r":3: "),
        ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n", "at least two"),
        ("arrived_at,num_prefill_tokens,num_decode_tokens\n5,1,1\n5,2,2\n", "same time"),
    ],
)
def test_bad_trace_is_a_clear_error(tmp_path: Path, content: str, message: str) -> None:
    trace = tmp_path / "bad.csv"
    trace.write_text(content)
    with pytest.raises(TraceError, match=message):
        read_trace(trace)


def test_missing_trace_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="No such file"):
        read_trace(tmp_path / "missing.csv")


def test_rescaled_trace_keeps_its_mean_rate_over_loops(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "trace.csv")
    workload = msgspec.structs.replace(WORKLOADS["trace"], trace=str(trace))
    requests = generate(workload, 10, 30, seed=1)
    assert len(requests) == 300
    assert math.isclose(requests[-1].time, 29.9)
