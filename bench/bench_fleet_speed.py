"""Benchmark: wall time of one ``lig bench`` run, 10 simulated minutes at 8 pods near saturation.

Run: ``.venv/bin/python bench/bench_fleet_speed.py [--repeats 3] [--duration 600]``.
Baseline, measured in the same run: the simulator's own ``VirtualFleet`` playing the same
requests with its built-in round-robin and no picker, i.e. the cost of the engines alone; the
ratio shows what the pickers, scrapes and bookkeeping of ``scheduling_bench.fleet`` add.
Target (issue 7): <= 30 s wall for the fleet run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from scheduling_bench.fleet import FleetConfig, simulate
from scheduling_bench.runner import engine_config
from scheduling_bench.workloads import WORKLOADS, generate
from shared.schemas import PolicyConfig
from simulator.profiles import DEFAULT_PROFILE, PROFILES
from simulator.virtual_time import Arrival, VirtualFleet

TARGET_S = 30.0


def main() -> int:
    """Time both runs ``--repeats`` times, print medians, the ratio and the verdict."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--duration", type=float, default=600.0, help="simulated seconds")
    parser.add_argument("--rate", type=float, default=270.0, help="req/s (8 pods saturate ~300)")
    parser.add_argument("--policy", default="filter-tree")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    workload = WORKLOADS["chat"]
    engine = engine_config(workload, PROFILES[DEFAULT_PROFILE])
    requests = generate(workload, args.rate, args.duration, args.seed)
    arrivals = [Arrival(request.time, request.spec) for request in requests]
    config = FleetConfig(pods=8, engine=engine)

    fleet_s: list[float] = []
    engines_s: list[float] = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        simulate(requests, PolicyConfig(name=args.policy), config, args.seed)
        fleet_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        VirtualFleet([engine] * 8, seed=args.seed).run(arrivals)
        engines_s.append(time.perf_counter() - start)

    fleet, engines = statistics.median(fleet_s), statistics.median(engines_s)
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    print(
        f"{len(requests)} requests, {args.duration:g} s simulated at {args.rate:g} req/s, 8 pods, "
        f"policy {args.policy}; median of {args.repeats}; Python {platform.python_version()}, "
        f"{os.cpu_count()} cores, load average {load}"
    )
    print(f"engines alone (simulator VirtualFleet, baseline): {engines:6.1f} s wall")
    print(f"lig bench fleet (pickers, scrapes, policy):      {fleet:6.1f} s wall "
          f"({fleet / engines:.2f}x baseline)")
    verdict = "ok" if fleet <= TARGET_S else "MISSED"
    print(f"target <= {TARGET_S:.0f} s: {fleet:.1f} s {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
