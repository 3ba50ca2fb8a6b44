"""The ``prefix-aware`` profile's ``lora_fit`` weight against the filter tree, on ``lig bench``.

How the default profile's weight was chosen (docs/scheduling.md, "Why prefix-aware is the
default"): each weight runs the ``prefix-aware`` profile (every other scorer at its default) on
the simulated fleet, beside ``filter-tree`` as the baseline of the same run (same workload,
seed and requests); the table gives TTFT p50/p90/p99, adapter loads and the ratio of TTFT p90
to the tree's. Points are virtual time, so the figures do not depend on the machine's load.

Run: ``.venv/bin/python bench/bench_profile_weights.py [--weights 1,3,3.25,3.5,4,8]
[--workload multi-lora] [--rates 90,180,270] [--pickers 1] [--duration 30]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduling_bench.runner import Point, run_points, with_scorer_weight
from scheduling_bench.workloads import WORKLOADS
from shared.schemas import PolicyConfig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", default="1,3,3.25,3.5,4,8",
                        help="comma-separated lora_fit weights")
    parser.add_argument("--workload", default="multi-lora", choices=sorted(WORKLOADS))
    parser.add_argument("--rates", default="90,180,270", help="comma-separated requests/s")
    parser.add_argument("--pickers", type=int, default=1)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    workload = WORKLOADS[args.workload]
    rates = [float(rate) for rate in args.rates.split(",")]
    policies = [("filter-tree", PolicyConfig("filter-tree"))] + [
        (f"lora_fit {weight}", with_scorer_weight("lora_fit", float(weight)))
        for weight in args.weights.split(",")]
    points = [Point(workload, policy, rate, args.duration, seed=args.seed, pickers=args.pickers,
                    alias=label) for rate in rates for label, policy in policies]
    results = run_points(points, jobs=args.jobs, progress=False)
    tree_p90: dict[float, float] = {}
    print(f"{args.workload}, {args.pickers} picker(s), {args.duration:.0f} s, seed {args.seed}")
    print(f"{'rate':>5} {'policy':16} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'loads':>6} "
          f"{'p90 / tree':>10}")
    for point, metrics in zip(points, results, strict=True):
        p50, p90, p99 = (value or 0.0 for value in (metrics.ttft.p50, metrics.ttft.p90,
                                                    metrics.ttft.p99))
        if point.alias == "filter-tree":
            tree_p90[point.rate] = p90
        ratio = p90 / tree_p90[point.rate] if tree_p90.get(point.rate) else float("nan")
        print(f"{point.rate:5.0f} {point.alias:16} {p50:9.3f} {p90:7.3f} {p99:7.3f} "
              f"{metrics.adapter_loads:6d} {ratio:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
