"""Show sweep results: markdown tables and PNG plots of latency percentiles against rate.

Plots need matplotlib (the ``bench`` extra); tables do not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from scheduling_bench.results import RunMetrics
from shared.schemas import Criticality


def format_seconds(value: float | None) -> str:
    """A latency for a table: 3 decimals under a second, 3 significant digits above, - if None."""
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 1 else f"{value:.3g}" if value < 100 else f"{value:.0f}"


def _ordered(results: Sequence[RunMetrics]) -> list[RunMetrics]:
    """By rate, then in the order the policies were given: rows to compare sit together."""
    policies = list(dict.fromkeys(result.policy for result in results))
    return sorted(results, key=lambda result: (result.rate, policies.index(result.policy)))


def markdown_table(results: Sequence[RunMetrics]) -> str:
    """One row per run: latencies in seconds, counts, throughput and engine counters."""
    lines = [
        "| rate (req/s) | policy | completed | shed | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 "
        "| ITL p99 | E2E p50 | E2E p99 | output tok/s | preemptions | adapter loads "
        "| prefix hit | prompt tokens computed |",
        "|---:|---|" + "---:|" * 14,
    ]
    for r in _ordered(results):
        latencies = (r.ttft.p50, r.ttft.p90, r.ttft.p99, r.itl.p50, r.itl.p99, r.e2e.p50, r.e2e.p99)
        lines.append(
            f"| {r.rate:g} | {r.policy} | {r.completed} | {r.shed} | "
            + " | ".join(format_seconds(value) for value in latencies)
            + f" | {r.output_tokens_per_s:.0f} | {r.preemptions} | {r.adapter_loads} "
            f"| {r.prefix_cache_hit_rate:.1%} | {r.computed_prompt_tokens / 1e6:.2f} M |"
        )
    return "\n".join(lines) + "\n"


def criticality_table(results: Sequence[RunMetrics]) -> str:
    """Per criticality: requests shed and TTFT p50/p99 of those served (seconds)."""
    classes = [str(criticality) for criticality in Criticality]
    header = "| rate (req/s) | policy | " + " | ".join(
        f"{name} shed | {name} TTFT p50 | {name} TTFT p99" for name in classes
    )
    lines = [header + " |", "|---:|---|" + "---:|" * (3 * len(classes))]
    for r in _ordered(results):
        cells = []
        for name in classes:
            metrics = r.by_criticality[name]
            cells.append(
                f"{metrics.shed}/{metrics.requests} | {format_seconds(metrics.ttft.p50)} "
                f"| {format_seconds(metrics.ttft.p99)}"
            )
        lines.append(f"| {r.rate:g} | {r.policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def has_mixed_criticality(results: Sequence[RunMetrics]) -> bool:
    """True when the runs had requests of more than one criticality."""
    return any(
        sum(1 for metrics in r.by_criticality.values() if metrics.requests) > 1 for r in results
    )


Panel = tuple[str, Callable[[RunMetrics], float | None], bool]


def _panels(results: Sequence[RunMetrics]) -> list[Panel]:
    """What each subplot shows: title, value, and whether a log y axis may suit it."""
    panels: list[Panel] = [
        ("TTFT p50 (s)", lambda r: r.ttft.p50, True),
        ("TTFT p99 (s)", lambda r: r.ttft.p99, True),
        ("ITL p99 (s)", lambda r: r.itl.p99, True),
        ("E2E p99 (s)", lambda r: r.e2e.p99, True),
        ("output tokens/s", lambda r: r.output_tokens_per_s, False),
    ]
    critical = str(Criticality.CRITICAL)
    if any(r.shed for r in results):
        panels.append(("shed (% of requests)", lambda r: 100 * r.shed / max(r.requests, 1), False))
    if has_mixed_criticality(results):
        panels.append(
            ("TTFT p99 of Critical (s)", lambda r: r.by_criticality[critical].ttft.p99, True)
        )
    if any(r.adapter_loads for r in results):
        panels.append(("adapter loads", lambda r: r.adapter_loads, False))
    if any(r.prefix_cache_hit_rate for r in results):
        panels.append(("prefix-cache hit (%)", lambda r: 100 * r.prefix_cache_hit_rate, False))
    if len(panels) == 5:
        panels.append(("ITL p50 (s)", lambda r: r.itl.p50, True))
    return panels


def plot(results: Sequence[RunMetrics], title: str, path: Path) -> None:
    """Write a PNG: one subplot per metric, rate on x, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    policies = list(dict.fromkeys(r.policy for r in results))
    panels = _panels(results)
    rows = -(-len(panels) // 3)
    figure, axes = plt.subplots(rows, 3, figsize=(12, 3.2 * rows), dpi=64, squeeze=False)
    for axis in axes.flat[len(panels) :]:
        axis.set_visible(False)
    for axis, (label, value, logarithmic) in zip(axes.flat, panels, strict=False):
        lines = []
        for policy in policies:
            runs = sorted((r for r in results if r.policy == policy), key=lambda r: r.rate)
            measured = [(r.rate, value(r)) for r in runs]
            lines.append((policy, [(x, y) for x, y in measured if y is not None]))
        values = [y for _, points in lines for _, y in points]
        # A log axis only where values span a decade; it needs them positive.
        logarithmic = logarithmic and min(values, default=0) > 0
        logarithmic = logarithmic and max(values) / min(values) > 10
        for policy, points in lines:
            if points:
                xs, ys = zip(*points, strict=True)
                axis.plot(xs, ys, marker="o", markersize=3, label=policy)
        axis.set_title(label, fontsize=10)
        axis.set_xlabel("request rate (req/s)", fontsize=9)
        axis.tick_params(labelsize=8)
        if logarithmic:
            axis.set_yscale("log")
            axis.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            axis.yaxis.set_minor_formatter(NullFormatter())
        axis.grid(True, alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
