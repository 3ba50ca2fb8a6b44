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

Run: ``.venv/bin/python bench/bench_prefill_estimate.py [--before before.json] [--seeds 1,2]
[--jobs 2] [--only prefix-fit|presets] [--json]``
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# The baseline run imports the other checkout's code (see _start_baseline).
sys.path.insert(0, os.environ.get("LIG_BENCH_REPO") or str(Path(__file__).resolve().parents[1]))

import msgspec

from scheduling_bench.default_sweep import PREFIX_FIT
from scheduling_bench.results import RunMetrics
from scheduling_bench.runner import Point, parse_policy, run_points
from scheduling_bench.workloads import WORKLOADS

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
                        help="print the results as JSON (what --baseline-tree reads)")
    args = parser.parse_args()
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
