"""Benchmark the vLLM metrics parser against prometheus_client's full parse of the same page.

    .venv/bin/python bench/bench_metrics_parser.py [--page PATH] [--runs N] [--baseline-runs N]

The collector parses every pod 20 times a second, so the target is a median of at most 0.5 ms
per parse of a realistic ~60 KB vLLM V1 page (tests/fixtures/metrics/vllm_v1.txt by default).
The baseline is what the parser replaces: prometheus_client's text parser reading the whole page.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from shared.vllm_metrics import parse_vllm_metrics

DEFAULT_PAGE = Path(__file__).resolve().parent.parent / "tests/fixtures/metrics/vllm_v1.txt"
TARGET_MS = 0.5


def time_calls(call: Callable[[], object], runs: int) -> list[float]:
    """Seconds per call for ``runs`` calls after a short warm-up, with the GC paused."""
    for _ in range(min(runs, 20)):
        call()
    times = []
    gc.disable()
    try:
        for _ in range(runs):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return times


def prometheus_client_parse(page: bytes) -> None:
    """The baseline: a full parse into metric families, as a general client would do."""
    for _ in text_string_to_metric_families(page.decode()):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page", type=Path, default=DEFAULT_PAGE, help="a /metrics page file")
    parser.add_argument("--runs", type=int, default=3000, help="timed parses of our parser")
    parser.add_argument("--baseline-runs", type=int, default=60, help="timed baseline parses")
    args = parser.parse_args()

    page = args.page.read_bytes()
    ours = time_calls(lambda: parse_vllm_metrics(page), args.runs)
    baseline = time_calls(lambda: prometheus_client_parse(page), args.baseline_runs)

    lines = page.count(b"\n")
    print(f"page: {args.page} ({len(page) / 1000:.1f} KB, {lines} lines)")
    print(f"{'parser':<34} {'runs':>6} {'median ms':>10} {'p90 ms':>8}")
    for name, times in (
        ("shared.vllm_metrics", ours),
        ("prometheus_client (full parse)", baseline),
    ):
        median_ms = statistics.median(times) * 1e3
        p90_ms = statistics.quantiles(times, n=10)[-1] * 1e3
        print(f"{name:<34} {len(times):>6} {median_ms:>10.3f} {p90_ms:>8.3f}")
    ratio = statistics.median(baseline) / statistics.median(ours)
    median_ms = statistics.median(ours) * 1e3
    verdict = "met" if median_ms <= TARGET_MS else "MISSED"
    print(f"speed-up: {ratio:.0f}x; target median <= {TARGET_MS} ms: {verdict}")


if __name__ == "__main__":
    main()
