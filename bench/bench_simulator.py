"""Benchmark the simulator in virtual time: simulated requests per wall second, 8 pods, saturated.

    .venv/bin/python bench/bench_simulator.py [--requests 10000] [--pods 8] [--runs 3]
                                              [--rate 1000] [--trace conv.csv]

Target (issue 5): 10,000 requests through 8 pods in at most 10 s of wall time.

Workload: requests arrive as a Poisson process at ``--rate`` per second, far above what 8 pods of
the default profile (Llama 3.1 8B on an H100) serve, so queues grow and every pod runs full
batches. Lengths follow the Azure LLM inference 2023 conversation trace (log-normal prompts of
about 1,200 tokens with a shared 200-token system prompt, outputs of about 210 tokens), or come
from the trace itself with ``--trace PATH`` (its ``num_prefill_tokens`` and
``num_decode_tokens`` columns; arrivals are still generated at ``--rate``).

Two drivers are timed on the same arrivals: round-robin routing (the baseline), and a router
that reads every pod's ``EngineSnapshot`` at each arrival and picks the shortest queue, as a
scheduling benchmark feeding a policy does. Each prints the median of ``--runs`` runs.
"""

from __future__ import annotations

import argparse
import csv
import platform
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from simulator.engine import EngineConfig, EngineSnapshot, RequestSpec, SyntheticPrompt
from simulator.virtual_time import Arrival, RunResult, VirtualFleet

TARGET_REQUESTS = 10_000
TARGET_SECONDS = 10.0
SYSTEM_PROMPT = (1, 200)  # (seed, tokens) shared by every request


def synthetic_lengths(count: int, rng: random.Random) -> list[tuple[int, int]]:
    """(prompt, output) tokens with the conversation trace's means and spread."""
    lengths = []
    for _ in range(count):
        prompt = min(8_000, max(16, int(rng.lognormvariate(6.7, 0.7))))
        output = min(2_000, max(1, int(rng.lognormvariate(4.9, 1.0))))
        lengths.append((prompt, output))
    return lengths


def trace_lengths(path: Path, count: int) -> list[tuple[int, int]]:
    """(prompt, output) tokens of the first ``count`` rows of an Azure trace CSV."""
    with path.open() as file:
        rows = [
            (int(row["num_prefill_tokens"]), max(1, int(row["num_decode_tokens"])))
            for row, _ in zip(csv.DictReader(file), range(count), strict=False)
        ]
    if len(rows) < count:
        rows = (rows * (count // len(rows) + 1))[:count]
    return rows


def make_arrivals(
    lengths: Sequence[tuple[int, int]], rate: float, rng: random.Random
) -> list[Arrival]:
    """Poisson arrivals; each prompt is the shared system prompt plus its own tokens."""
    arrivals = []
    now = 0.0
    for index, (prompt, output) in enumerate(lengths):
        now += rng.expovariate(rate)
        own = max(1, prompt - SYSTEM_PROMPT[1])
        prompt_spec = SyntheticPrompt((SYSTEM_PROMPT, (1000 + index, own)))
        spec = RequestSpec(f"r{index}", prompt_spec, output)
        arrivals.append(Arrival(now, spec))
    return arrivals


def shortest_queue(_: Arrival, snapshots: Sequence[EngineSnapshot]) -> int:
    """Route to the pod with the fewest waiting, then running, requests."""
    return min(range(len(snapshots)), key=lambda i: (snapshots[i].waiting, snapshots[i].running))


def run_once(arrivals: list[Arrival], pods: int, routed: bool) -> tuple[RunResult, float]:
    """One run and the CPU seconds it took (steadier than wall time on a shared host)."""
    fleet = VirtualFleet([EngineConfig()] * pods, seed=1)
    cpu = time.process_time()
    run = fleet.run(arrivals, router=shortest_queue if routed else None)
    return run, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=TARGET_REQUESTS)
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rate", type=float, default=1000.0, help="arrivals per second")
    parser.add_argument("--trace", type=Path, help="Azure LLM inference 2023 CSV for lengths")
    args = parser.parse_args()

    rng = random.Random(7)
    lengths = (
        trace_lengths(args.trace, args.requests)
        if args.trace
        else synthetic_lengths(args.requests, rng)
    )
    arrivals = make_arrivals(lengths, args.rate, rng)
    mean_prompt = statistics.fmean(prompt for prompt, _ in lengths)
    mean_output = statistics.fmean(output for _, output in lengths)
    print(
        f"simulator benchmark: {args.requests} requests, {args.pods} pods, arrivals at "
        f"{args.rate:g}/s; prompt {mean_prompt:.0f} / output {mean_output:.0f} tokens on "
        f"average; Python {platform.python_version()}"
    )

    medians = {}
    for label, routed in (("round-robin (baseline)", False), ("snapshot router", True)):
        timed = [run_once(arrivals, args.pods, routed) for _ in range(args.runs)]
        wall = statistics.median(run.wall_seconds for run, _ in timed)
        cpu = statistics.median(cpu for _, cpu in timed)
        medians[label] = wall
        run = timed[0][0]
        totals = run.totals()
        assert totals.finished == args.requests, "every request must complete"
        ttft = statistics.median(r.ttft for r in run.requests if r.ttft is not None)
        print(
            f"  {label:<24} wall {wall:5.2f} s, CPU {cpu:5.2f} s (medians of {args.runs}) | "
            f"{args.requests / wall:7.0f} requests/s, "
            f"{(totals.prompt_tokens + totals.generation_tokens) / wall / 1e6:5.2f} M tokens/s | "
            f"simulated {run.end_time:6.1f} s = {run.end_time / wall:4.1f}x real time | "
            f"{totals.steps} steps, {totals.preemptions} preemptions, median TTFT {ttft:.2f} s"
        )
    baseline, routed_wall = medians.values()
    print(f"  snapshot router / baseline wall time: {routed_wall / baseline:.2f}x")
    per_target = baseline * TARGET_REQUESTS / args.requests
    verdict = "meets" if per_target <= TARGET_SECONDS else "misses"
    print(
        f"  target: {TARGET_REQUESTS} requests in <= {TARGET_SECONDS:g} s -> "
        f"{per_target:.2f} s ({verdict}; {TARGET_SECONDS / per_target:.1f}x headroom)"
    )


if __name__ == "__main__":
    main()
