"""The load estimate counting prefill (uncached prompt tokens) against counting whole prompts.

Runs the points that matter of ``lig bench`` and prints them, with their ratio to the same points
run by the old code (``--before``: this script's ``--json`` output, run with the old checkout's
code: ``LIG_BENCH_REPO=/tmp/base PYTHONPATH=/tmp/base``, where ``git archive <commit> | tar -x
-C /tmp/base`` made it; start both at once, they take the same time). Points (virtual time: one
run per point is the figure, the same on any machine; ``--seeds`` repeats them):

- the shared prefixes that do not fit (256 x 4,000 tokens, token-id prompts, 100 req/s, one
  picker): ``default`` (approximate index), ``default+precise``, ``default+precise+oracle``
  (the bound), and ``default`` with 4 replicas that do not share decisions;
- the default sweep's other workloads under ``default``: ``chat``, ``multi-lora``,
  ``shared-prefix`` and ``multi-turn`` at a medium and a high rate.

``--cost`` measures instead what the estimate adds to the request path: CPU per request of
``Gateway.started`` (which computes the pod's prefill tokens) against the same bookkeeping given
the whole prompt (``PodTable.started(pod, prompt_tokens)``, as before), for a 4,000-token prompt
whose prefix its pod holds, in the same run; and route + started together, for scale. Medians of
``--rounds`` rounds of ``--requests`` requests (``time.process_time``).

Run: ``.venv/bin/python bench/bench_prefill_estimate.py [--before before.json] [--seeds 1,2]
[--jobs 2] [--only prefix-fit|presets] [--json] [--cost]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

# The old code's run imports the other checkout's code (LIG_BENCH_REPO, see the module doc).
sys.path.insert(0, os.environ.get("LIG_BENCH_REPO") or str(Path(__file__).resolve().parents[1]))

import msgspec

from bench.bench_decision_stream import build_gateway
from scheduling_bench.default_sweep import PREFIX_FIT
from scheduling_bench.results import RunMetrics
from scheduling_bench.runner import Point, parse_policy, run_points
from scheduling_bench.workloads import WORKLOADS
from services.picker.routing import Routed

DURATION = 30.0
# (workload, rates) of the default sweep's presets under ``default`` (medium and high load).
PRESETS = (("chat", (180.0, 270.0)), ("multi-lora", (90.0, 180.0)),
           ("shared-prefix", (180.0, 270.0)), ("multi-turn", (180.0, 270.0)))


def prefix_fit_points(seed: int) -> list[Point]:
    """The shared prefixes that do not fit, by prefix source, and 4 unshared replicas."""
    workload = msgspec.structs.replace(WORKLOADS["shared-prefix"], **PREFIX_FIT, token_ids=True,
                                       chat=False)
    points = [Point(workload, **parse_policy(label).fields(), rate=100.0, duration=DURATION,
                    seed=seed)
              for label in ("default", "default+precise", "default+precise+oracle")]
    points.append(Point(workload, **parse_policy("default").fields(), rate=100.0,
                        duration=DURATION, seed=seed, pickers=4, shared_decisions=False))
    return points


def preset_points(seed: int) -> list[Point]:
    """The default sweep's presets under ``default``."""
    return [Point(WORKLOADS[name], **parse_policy("default").fields(), rate=rate,
                  duration=DURATION, seed=seed)
            for name, rates in PRESETS for rate in rates]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path,
                        help="results of the same points by the old code (--json), for ratios")
    parser.add_argument("--seeds", default="1", help="comma-separated seeds")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes per tree")
    parser.add_argument("--only", choices=("prefix-fit", "presets"),
                        help="run one group of points")
    parser.add_argument("--json", action="store_true",
                        help="print the results as JSON (what --before reads)")
    parser.add_argument("--cost", action="store_true",
                        help="measure the request-path cost instead (see above)")
    parser.add_argument("--requests", type=int, default=20_000, help="--cost: per round")
    parser.add_argument("--rounds", type=int, default=7, help="--cost: rounds")
    args = parser.parse_args()
    if args.cost:
        _cost(args.requests, args.rounds)
        return 0
    points: list[Point] = []
    for seed in (int(seed) for seed in args.seeds.split(",")):
        if args.only != "presets":
            points += prefix_fit_points(seed)
        if args.only != "prefix-fit":
            points += preset_points(seed)
    results = run_points(points, jobs=args.jobs, progress=not args.json)
    if args.json:
        sys.stdout.buffer.write(msgspec.json.encode(results))
        return 0
    before = None
    if args.before is not None:
        before = msgspec.json.decode(args.before.read_bytes(), type=list[RunMetrics])
    _print(results, before)
    return 0


def _cost(requests: int, rounds: int) -> None:
    """Print the request-path cost of counting prefill tokens (see the module doc)."""
    body = msgspec.json.encode({"model": "m", "max_tokens": 64,
                                "prompt": "a shared system prompt " * 700})  # ~4,000 tokens
    gateway = build_gateway(None)
    first = gateway.route(body)
    assert isinstance(first, Routed)
    table = gateway.table(first.pool)
    assert table is not None
    routed = gateway.route(body, frozenset({first.endpoint}))  # its pod holds the prefix now
    assert isinstance(routed, Routed) and routed.prefill_on(routed.pod) < routed.prompt_tokens

    def prefill() -> float:
        started, finished = gateway.started, table.finished
        start = time.process_time()
        for _ in range(requests):
            started(routed)
            finished(routed.pod)
        return (time.process_time() - start) / requests

    def whole_prompt() -> float:
        started, finished = table.started, table.finished
        pod, tokens = routed.pod, routed.prompt_tokens
        start = time.process_time()
        for _ in range(requests):
            started(pod, tokens)
            finished(pod)
        return (time.process_time() - start) / requests

    def route_and_start() -> float:
        route, started, finished = gateway.route, gateway.started, table.finished
        count = max(1, requests // 10)
        start = time.process_time()
        for _ in range(count):
            decision = route(body)
            assert isinstance(decision, Routed)
            started(decision)
            finished(decision.pod)
        return (time.process_time() - start) / count

    new, old, whole = [], [], []
    for _ in range(rounds):  # interleaved, so that the machine's load hits both alike
        new.append(prefill())
        old.append(whole_prompt())
        whole.append(route_and_start())
    new_us, old_us = statistics.median(new) * 1e6, statistics.median(old) * 1e6
    print(f"{routed.prompt_tokens} prompt tokens, {routed.prefill_on(routed.pod)} to prefill; "
          f"medians of {rounds} rounds of {requests} requests, CPU per request:")
    print(f"started + finished, prefill tokens (Gateway.started): {new_us:.2f} us")
    print(f"started + finished, whole prompt (as before):        {old_us:.2f} us "
          f"(ratio {new_us / old_us:.2f}, +{new_us - old_us:.2f} us)")
    print(f"route + started + finished:                           "
          f"{statistics.median(whole) * 1e6:.1f} us")


def _print(after: list[RunMetrics], before: list[RunMetrics] | None) -> None:
    print(f"{'workload':14} {'rate':>5} {'pickers':>7} {'policy':24} {'seed':>4} "
          f"{'TTFT p50':>9} {'p90':>7} {'p99':>7} {'hit':>6} {'E2E p50':>8}"
          + (f" {'p90 before':>10} {'hit before':>10} {'p90 ratio':>9} {'p99 ratio':>9}"
             if before else ""))
    for index, r in enumerate(after):
        line = (f"{r.workload:14} {r.rate:>5g} {r.pickers:>7} {r.policy:24} {r.seed:>4} "
                f"{_s(r.ttft.p50):>9} {_s(r.ttft.p90):>7} {_s(r.ttft.p99):>7} "
                f"{r.prefix_cache_hit_rate:>6.1%} {_s(r.e2e.p50):>8}")
        if before:
            b = before[index]
            line += (f" {_s(b.ttft.p90):>10} {b.prefix_cache_hit_rate:>10.1%} "
                     f"{_ratio(r.ttft.p90, b.ttft.p90):>9} {_ratio(r.ttft.p99, b.ttft.p99):>9}")
        print(line)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}"


if __name__ == "__main__":
    sys.exit(main())
