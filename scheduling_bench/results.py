"""The numbers of one run: latency percentiles, throughput, sheds and engine counters.

Latencies are in seconds of virtual time, from the request's arrival at the picker:
- TTFT: until its first output token;
- ITL: its mean time between two output tokens, ``(last - first) / (n - 1)`` (what vLLM's
  benchmark calls TPOT), for requests with at least two tokens;
- E2E: until its last token.
Percentiles interpolate linearly between the sorted values (numpy's default).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from scheduling_bench.fleet import FleetRun, Outcome
from shared.schemas import Criticality
from simulator.engine import Request


class Percentiles(msgspec.Struct, frozen=True):
    """p50, p90 and p99 of a latency, in seconds; None when no request had one."""

    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


class ClassMetrics(msgspec.Struct, frozen=True):
    """The outcome of the requests of one criticality."""

    requests: int = 0
    completed: int = 0
    shed: int = 0
    ttft: Percentiles = Percentiles()
    e2e: Percentiles = Percentiles()


class RunMetrics(msgspec.Struct, frozen=True):
    """Everything reported for one run (one workload, policy and rate)."""

    workload: str
    policy: str
    rate: float
    duration: float
    pods: int
    pickers: int
    scrape_interval: float
    propagation_delay: float
    seed: int
    requests: int
    completed: int
    shed: int
    no_pod: int
    """Requests the policy found no pod for and did not shed (503)."""
    rejected: int
    """Requests the chosen pod refused (400)."""
    ttft: Percentiles
    itl: Percentiles
    e2e: Percentiles
    prompt_tokens: int
    computed_prompt_tokens: int
    """Prompt tokens the engines computed: not found in their prefix cache (first scheduling)."""
    output_tokens: int
    output_tokens_per_s: float
    """Output tokens over the virtual time from the start until the last request ended."""
    preemptions: int
    adapter_loads: int
    """Adapters moved into a GPU slot (from the CPU cache or from disk), over all pods."""
    prefix_cache_hit_rate: float
    """Prompt tokens found in the prefix cache / prompt tokens looked up, over all pods."""
    by_criticality: dict[str, ClassMetrics]
    sim_seconds: float
    """Virtual time when the last request ended."""
    wall_seconds: float
    shared_decisions: bool = False
    """Picker replicas applied each other's decisions (the decision stream)."""
    decision_delay: float = 0.0
    """Seconds a decision took to reach the other replicas, when shared."""
    kv_event_delay: float = 0.0
    """Seconds from an engine step until its KV-cache events reached the pickers' precise
    prefix index (0 when the run had none, or with ``+oracle``)."""


def percentile(ordered: Sequence[float], fraction: float) -> float | None:
    """The ``fraction`` quantile of already sorted values, interpolated; None when empty."""
    if not ordered:
        return None
    position = (len(ordered) - 1) * fraction
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def percentiles(values: list[float]) -> Percentiles:
    """p50, p90 and p99 of ``values``."""
    values.sort()
    return Percentiles(percentile(values, 0.5), percentile(values, 0.9), percentile(values, 0.99))


def summarize(
    run: FleetRun,
    *,
    workload: str,
    policy: str,
    rate: float,
    duration: float,
    pickers: int,
    scrape_interval: float,
    propagation_delay: float,
    seed: int,
    decision_delay: float = 0.0,
    kv_event_delay: float = 0.0,
) -> RunMetrics:
    """Reduce a run to its :class:`RunMetrics`."""
    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    classes = {criticality: _ClassTally() for criticality in Criticality}
    prompt_tokens = output_tokens = computed = 0
    counts = dict.fromkeys(Outcome, 0)
    for bench_request, outcome, record in zip(run.requests, run.outcomes, run.records, strict=True):
        counts[outcome] += 1
        tally = classes[bench_request.criticality]
        tally.requests += 1
        if outcome is Outcome.SHED:
            tally.shed += 1
        if record is None:
            continue
        first, last = _token_times(record)
        arrived = record.arrival_time
        ttft.append(first - arrived)
        e2e.append(last - arrived)
        if record.num_output > 1:
            itl.append((last - first) / (record.num_output - 1))
        tally.completed += 1
        tally.ttft.append(first - arrived)
        tally.e2e.append(last - arrived)
        prompt_tokens += record.num_prompt_tokens
        computed += record.num_prompt_tokens - max(record.num_cached_tokens, 0)
        output_tokens += record.num_output
    hits = sum(counters.prefix_cache_hits for counters in run.counters)
    queries = sum(counters.prefix_cache_queries for counters in run.counters)
    return RunMetrics(
        workload=workload,
        policy=policy,
        rate=rate,
        duration=duration,
        pods=len(run.counters),
        pickers=pickers,
        scrape_interval=scrape_interval,
        propagation_delay=propagation_delay,
        seed=seed,
        requests=len(run.requests),
        completed=counts[Outcome.COMPLETED],
        shed=counts[Outcome.SHED],
        no_pod=counts[Outcome.NO_POD],
        rejected=counts[Outcome.REJECTED],
        ttft=percentiles(ttft),
        itl=percentiles(itl),
        e2e=percentiles(e2e),
        prompt_tokens=prompt_tokens,
        computed_prompt_tokens=computed,
        output_tokens=output_tokens,
        output_tokens_per_s=output_tokens / run.end_time if run.end_time > 0 else 0.0,
        preemptions=sum(counters.preemptions for counters in run.counters),
        adapter_loads=sum(counters.adapter_loads for counters in run.counters),
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        by_criticality={
            str(criticality): tally.metrics() for criticality, tally in classes.items()
        },
        sim_seconds=run.end_time,
        wall_seconds=run.wall_seconds,
        shared_decisions=run.shared_decisions,
        decision_delay=decision_delay if run.shared_decisions else 0.0,
        kv_event_delay=kv_event_delay,
    )


def _token_times(record: Request) -> tuple[float, float]:
    first, last = record.first_token_time, record.finish_time
    if first is None or last is None:
        raise ValueError(f"request {record.request_id} did not finish")
    return first, last


class _ClassTally:
    def __init__(self) -> None:
        self.requests = self.completed = self.shed = 0
        self.ttft: list[float] = []
        self.e2e: list[float] = []

    def metrics(self) -> ClassMetrics:
        return ClassMetrics(
            requests=self.requests,
            completed=self.completed,
            shed=self.shed,
            ttft=percentiles(self.ttft),
            e2e=percentiles(self.e2e),
        )
