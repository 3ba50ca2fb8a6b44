"""Benchmark: median time of one scheduling decision per policy at 10, 100 and 1,000 pods.

Run: ``.venv/bin/python bench/bench_scheduling.py``. The ``random`` policy (no tree, one
random choice) is the in-run baseline; each cell shows the median and its ratio to ``random``
at the same pod count. Targets (issue 2): filter-tree <= 50 µs at 100 pods, <= 500 µs at 1,000.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

from scheduling import (
    PodView,
    Policy,
    SchedulingRequest,
    build_policy,
    policy_names,
)
from shared.schemas import Criticality, PolicyConfig

SIZES = (10, 100, 1000)
TARGETS_US = {100: 50.0, 1000: 500.0}
BASE_MODEL = "llama-3-8b"
ADAPTERS = [f"adapter-{i}" for i in range(30)]


def make_pods(count: int, rng: random.Random) -> list[PodView]:
    """A fleet with mostly short queues, some saturated pods, 4 LoRA slots, 0-4 adapters each."""
    pods = []
    for i in range(count):
        saturated = rng.random() < 0.2
        pods.append(
            PodView(
                name=f"vllm-{i}",
                address=f"10.0.{i // 250}.{i % 250}:8000",
                waiting=rng.randint(40, 120) if saturated else rng.randint(0, 12),
                running=rng.randint(0, 64),
                kv_cache_usage=rng.uniform(0.7, 1.0) if saturated else rng.uniform(0.0, 0.8),
                running_adapters=frozenset(rng.sample(ADAPTERS, rng.randint(0, 4))),
                waiting_adapters=frozenset(rng.sample(ADAPTERS, 1) if rng.random() < 0.1 else ()),
                max_lora=4,
                in_flight=rng.randint(0, 4),
            )
        )
    return pods


def make_requests(count: int, rng: random.Random) -> list[SchedulingRequest]:
    """70% adapter requests (Critical/Standard), 10% base model, 20% sheddable adapter requests."""
    requests = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.1:
            requests.append(SchedulingRequest(BASE_MODEL, BASE_MODEL, Criticality.STANDARD))
            continue
        adapter = rng.choice(ADAPTERS)
        criticality = (
            Criticality.SHEDDABLE
            if roll < 0.3
            else rng.choice([Criticality.CRITICAL, Criticality.STANDARD])
        )
        requests.append(SchedulingRequest("food-review", adapter, criticality))
    return requests


def median_us(
    policy: Policy,
    requests: list[SchedulingRequest],
    pods: list[PodView],
    decisions: int,
    explain: bool,
) -> float:
    """Median wall time of one ``schedule`` call, in microseconds."""
    clock = time.perf_counter_ns
    schedule = policy.schedule
    for request in requests[:50]:  # warm-up
        schedule(request, pods, explain=explain)
    samples = []
    for i in range(decisions):
        request = requests[i % len(requests)]
        start = clock()
        schedule(request, pods, explain=explain)
        samples.append(clock() - start)
    return statistics.median(samples) / 1000


def main() -> int:
    """Measure, print the table and the verdict on the targets."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=3000, help="timed decisions per cell")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    fleets = {size: make_pods(size, rng) for size in SIZES}
    requests = make_requests(512, rng)
    rows = [(name, name, False) for name in policy_names()]
    rows.append(("filter-tree explain=True", "filter-tree", True))

    results: dict[str, dict[int, float]] = {}
    for label, name, explain in rows:
        policy = build_policy(PolicyConfig(name=name), random.Random(args.seed))
        results[label] = {
            size: median_us(policy, requests, fleets[size], args.decisions, explain)
            for size in SIZES
        }

    baseline = results["random"]
    print(
        f"median µs per decision ({args.decisions} decisions per cell; ratio vs 'random'); "
        f"Python {platform.python_version()}"
    )
    print(f"{'policy':<26}" + "".join(f"{f'{size} pods':>20}" for size in SIZES))
    for label, medians in results.items():
        cells = "".join(
            f"{f'{medians[size]:.1f} ({medians[size] / baseline[size]:.1f}x)':>20}"
            for size in SIZES
        )
        print(f"{label:<26}{cells}")
    for size, target in TARGETS_US.items():
        measured = results["filter-tree"][size]
        verdict = "ok" if measured <= target else "MISSED"
        print(f"target filter-tree {size} pods <= {target:.0f} µs: {measured:.1f} µs {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
