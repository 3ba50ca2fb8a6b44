"""Why the precise prefix index gains what it gains on ``lig bench``: its knobs, one at a time.

The shared prefixes that do not fit (256 x 4,000 tokens, prompts as token ids) at one rate, with
one picker: the approximate index (``default``) as the baseline of the same run, then the precise
index (``default+precise``) as ``lig picker`` runs it, and with one thing changed each:

- the KV-event delay (``--kv-event-delay``: 0 and 100 ms against the default 30 ms);
- speculation off (``--speculative-ttl 0``);
- the prompt blocks it looks up capped at N (``services/picker/routing.py``
  ``MAX_PRECISE_KEYS``, 2,048 blocks by default: the whole prompt), which changes the
  ``prefix_affinity`` score from "fraction of the prompt cached" to "fraction of its first N
  blocks cached";
- the ``prefix_affinity`` weight of the ``prefix-aware`` profile (2 by default), also with the
  approximate index;
- exact state (``+oracle``: exact metrics, events at once), the bound.

The table gives TTFT p50/p90/p99, the prefix-cache hit rate, TTFT p90 against the approximate
index's and the hit rate against ``default+precise+oracle``'s. Points run in virtual time: the
figures do not depend on the machine's load, and one run per point is the figure (no spread).

Run: ``.venv/bin/python bench/bench_prefix_sources.py [--rate 100] [--duration 30]
[--pickers 1] [--caps 64,256] [--weights 3,4]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec

from scheduling_bench.default_sweep import PREFIX_FIT
from scheduling_bench.results import RunMetrics
from scheduling_bench.runner import Point, parse_policy, run_point, run_points, with_scorer_weight
from scheduling_bench.workloads import WORKLOADS
from services.picker import routing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--pickers", type=int, default=1)
    parser.add_argument("--caps", default="64,256",
                        help="comma-separated caps on the prompt blocks looked up")
    parser.add_argument("--weights", default="3,4",
                        help="comma-separated prefix_affinity weights")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    workload = msgspec.structs.replace(WORKLOADS["shared-prefix"], **PREFIX_FIT, token_ids=True,
                                       chat=False)

    def point(label: str) -> Point:
        return Point(workload, **parse_policy(label).fields(), rate=args.rate,
                     duration=args.duration, seed=args.seed, pickers=args.pickers)

    precise = point("default+precise")
    replace = msgspec.structs.replace

    variants: dict[str, Point] = {
        "default": point("default"),
        "default+precise": point("default+precise"),
        "default+precise+oracle": point("default+precise+oracle"),
        "default+oracle": point("default+oracle"),
        "precise, events at once": replace(precise, kv_event_delay=0.0),
        "precise, events after 100 ms": replace(precise, kv_event_delay=0.1),
        "precise, no speculation": replace(precise, speculative_ttl=0.0),
    }
    for weight in args.weights.split(","):
        policy = with_scorer_weight("prefix_affinity", float(weight))
        variants[f"precise, prefix weight {weight}"] = replace(precise, policy=policy)
        variants[f"approximate, prefix weight {weight}"] = replace(point("default"),
                                                                   policy=policy)
    by_label = dict(zip(variants, run_points(list(variants.values()), jobs=args.jobs,
                                             progress=False), strict=True))
    # The cap is a module constant of the router, read per request: these run in this process.
    default_cap = routing.MAX_PRECISE_KEYS
    for cap in args.caps.split(","):
        routing.MAX_PRECISE_KEYS = int(cap)
        by_label[f"precise, first {cap} blocks"] = run_point(precise)
    routing.MAX_PRECISE_KEYS = default_cap
    approximate, bound = by_label["default"], by_label["default+precise+oracle"]
    print(f"shared prefixes that do not fit, {args.rate:g} req/s, {args.pickers} picker(s), "
          f"{args.duration:g} s, seed {args.seed}")
    print(f"{'variant':36} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'hit':>6} "
          f"{'p90 / default':>13} {'hit / bound':>11}")
    for label, r in by_label.items():
        print(f"{label:36} {_s(r.ttft.p50):>9} {_s(r.ttft.p90):>7} {_s(r.ttft.p99):>7} "
              f"{r.prefix_cache_hit_rate:>6.1%} {_ratio(r, approximate):>13} "
              f"{r.prefix_cache_hit_rate / bound.prefix_cache_hit_rate:>11.2f}")
    return 0


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio(r: RunMetrics, base: RunMetrics) -> str:
    if r.ttft.p90 is None or not base.ttft.p90:
        return "-"
    return f"{r.ttft.p90 / base.ttft.p90:.2f}"


if __name__ == "__main__":
    sys.exit(main())
