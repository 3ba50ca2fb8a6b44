"""``lig replay --what-if`` speed: recorded decisions re-decided per second, per policy.

Writes one recording of ``--decisions`` flight records (``--pods`` pods per view, two pickers,
decided by the real ``--recorded`` policy under the draw contract, with snapshots and
decision-stream messages between them; tests/support/recorded_decisions.py), then per round:

- ``decode`` (baseline): the same file streamed through :func:`recording.records.read_records`
  (decompress, frame, decode every record batch, registry kept), records dropped;
- one what-if per policy (``recorded`` = the file's policy, and each catalog policy): the same
  read plus, per decision, the draw-contract re-run and the report's tallies
  (:func:`recording.whatif.what_if` with one policy spec, ``--top 10``);
- one what-if with every policy at once (``--policies recorded,prefix-aware,...``): the file is
  read once for all of them, so its rate is given per policy (decisions x policies / s).

Prints medians over ``--rounds``: decisions per second for each and its ratio to the decode
baseline (the share of the time the policy and tallies take is 1 - ratio). Issue-14 target:
≥ 20,000 decisions/s per policy on this machine.

Run: ``.venv/bin/python bench/bench_whatif.py [--decisions 20000] [--pods 16] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.flags import at_least
from recording.fileformat import read_header
from recording.records import ReadCounts, Registry, read_records
from recording.rerun import parse_policy_specs
from recording.whatif import what_if
from scheduling import policy_names
from shared.schemas import PolicyConfig
from tests.support.recorded_decisions import Spec, write

TOP = 10


def decode_only(path: Path) -> int:
    """Baseline: every record read and dropped; decisions read."""
    counts = ReadCounts()
    with path.open("rb") as source:
        read_header(source)
        for _ in read_records(source, Registry(), counts):
            pass
    return counts.decisions


def whatif_once(path: Path, policies: str) -> int:
    """One what-if pass; decisions re-decided, summed over the policies."""
    specs = parse_policy_specs(policies)
    with path.open("rb") as source:
        header = read_header(source)
        report = what_if(source, header, specs, TOP)
    return sum(policy.decisions for policy in report.policies)


def rate(run: Callable[[], int], expected: int) -> tuple[float, float]:
    """Decisions per wall second and per CPU second of one run (checked against
    ``expected``). On a shared machine the CPU figure is the steadier one: it leaves out the
    time other processes held the core."""
    began, began_cpu = time.perf_counter(), time.process_time()
    done = run()
    elapsed, cpu = time.perf_counter() - began, time.process_time() - began_cpu
    if done != expected:
        raise SystemExit(f"read {done} decisions, expected {expected}")
    return done / elapsed, done / cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--decisions", type=at_least(1), default=20_000,
                        help="decision records in the recording (default: 20000)")
    parser.add_argument("--pods", type=at_least(1), default=16,
                        help="pods in every recorded decision's view (default: 16)")
    parser.add_argument("--rounds", type=at_least(1), default=5,
                        help="rounds of every measurement; medians reported (default: 5)")
    parser.add_argument("--recorded", default="prefix-aware", choices=policy_names(),
                        help="the policy the recording was decided with")
    args = parser.parse_args()
    policies = ["recorded", *policy_names()]
    together = ",".join(policies)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.ligrec"
        write(path, Spec(decisions=args.decisions, pods=args.pods,
                         policy=PolicyConfig(args.recorded)))
        size = path.stat().st_size
        decode: list[tuple[float, float]] = []
        rates: dict[str, list[tuple[float, float]]] = {
            policy: [] for policy in [*policies, together]}
        for _ in range(args.rounds):
            decode.append(rate(lambda: decode_only(path), args.decisions))
            for policy in policies:
                rates[policy].append(rate(lambda p=policy: whatif_once(path, p),  # type: ignore[misc]
                                          args.decisions))
            rates[together].append(rate(lambda: whatif_once(path, together),
                                        args.decisions * len(policies)))
    print(f"{args.decisions} decisions of {args.pods} pods (recorded with {args.recorded}; "
          f"file {size:,} B, {size / args.decisions:.0f} B/decision), medians of "
          f"{args.rounds} rounds, decisions per wall second and per CPU second:")
    base_wall, base_cpu = medians(decode)
    print(f"  {'decode only (baseline)':<24} {base_wall:>9,.0f}/s wall  {base_cpu:>9,.0f}/s CPU")
    for policy in [*policies, together]:
        wall, cpu = medians(rates[policy])
        verdict = "ok" if min(wall, cpu) >= 20_000 else (
            "ok in CPU time" if cpu >= 20_000 else "BELOW TARGET")
        label = "what-if " + (policy if policy != together else "all in one pass")
        print(f"  {label:<24} {wall:>9,.0f}/s wall  {cpu:>9,.0f}/s CPU   "
              f"{cpu / base_cpu:.2f}x of decode (CPU)   target >= 20,000/s: {verdict}")
    return 0


def medians(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """Median wall and CPU rates."""
    return (statistics.median(wall for wall, _ in samples),
            statistics.median(cpu for _, cpu in samples))


if __name__ == "__main__":
    sys.exit(main())
