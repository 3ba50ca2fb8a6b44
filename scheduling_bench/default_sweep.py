"""The default sweep behind ``docs/benchmarks.md``, and the rewrite of that document's numbers.

The document is prose written by hand around generated blocks::

    <!-- bench:NAME -->
    ...generated...
    <!-- /bench:NAME -->

``regenerate`` runs the sweep, writes one PNG per workload beside the document, and replaces
every block's content; the prose stays as it is. A block the document lacks is an error, so
the numbers can never be half updated.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from pathlib import Path

import msgspec

from scheduling_bench import report
from scheduling_bench.results import RunMetrics
from scheduling_bench.runner import (
    ORACLE_SUFFIX,
    Point,
    engine_config,
    parse_policy,
    run_points,
)
from scheduling_bench.workloads import WORKLOADS
from shared.schemas import PolicyConfig
from simulator.profiles import DEFAULT_PROFILE, PROFILES

# filter-tree+raw: the same tree without the pickers' load estimate (upstream's behaviour);
# default: lig picker's default policy; default+oracle: the same on every pod's exact state (the
# bound).
POLICIES = ("round-robin", "random", "least-queue", "filter-tree", "filter-tree+raw", "default",
            "default+oracle")
DURATION = 30.0
SEED = 1

# Per workload: rates from light load to overload of 8 pods of the default profile. The baselines
# saturate far earlier on multi-LoRA traffic (see the document), hence its lower rates.
RATES: dict[str, tuple[float, ...]] = {
    "chat": (60, 180, 270, 360),
    "trace": (60, 180, 270, 360),
    "multi-lora": (30, 90, 180, 270),
    "shared-prefix": (60, 180, 270, 360),
    "mixed-criticality": (60, 180, 270, 360),
    "multi-turn": (60, 180, 270, 360),
}

# Why the filter tree's TTFT depends on metric freshness: the chat workload at a medium rate
# under several scrape intervals, and with picker replicas that each count only their own
# requests in flight.
FRESHNESS_RATE = 180.0
FRESHNESS_POLICIES = ("round-robin", "least-queue", "filter-tree", "filter-tree+raw")
FRESHNESS_VARIANTS = ((0.01, 1), (0.05, 1), (0.2, 1), (0.05, 4))  # (scrape interval, pickers)


# Picker replicas against one picker: the default policy on chat (50 and 200 ms scrapes) and
# multi-LoRA, with 1 picker, 4 that share their decisions, and 4 that do not.
REPLICA_POINTS = (("chat", 180.0, 0.05), ("chat", 270.0, 0.05), ("chat", 180.0, 0.2),
                  ("chat", 270.0, 0.2), ("multi-lora", 180.0, 0.05))
REPLICA_VARIANTS = ((1, True), (4, True), (4, False))  # (pickers, shared decisions)

# Shared prefixes that do not fit every pod's KV cache: 256 system prompts of 4,000 tokens.
PREFIX_FIT = {"prefix_groups": 256, "prefix_tokens": 4_000}
PREFIX_FIT_RATE = 100.0
PREFIX_FIT_POLICIES = ("round-robin", "filter-tree", "default", "default+oracle")

# Where prefix matches come from (issue 16): none, the approximate index, the pods' KV-cache
# events (precise), each also with exact state. Workloads send token ids (the engines compute on
# them, so the events carry them); the first is the shared prefix that does not fit, then the
# same with 4 picker replicas that do not share decisions (each one's approximate index sees a
# quarter of the routing), then presets. (workload, its overrides, rate, pickers, shared).
PREFIX_SOURCE_POLICIES = ("default+no-prefix", "default", "default+precise", "default+oracle",
                          "default+precise+oracle")
PREFIX_SOURCE_POINTS: tuple[tuple[str, dict[str, int], float, int, bool], ...] = (
    ("shared-prefix", PREFIX_FIT, PREFIX_FIT_RATE, 1, True),
    ("shared-prefix", PREFIX_FIT, PREFIX_FIT_RATE, 4, False),
    ("shared-prefix", {}, 180.0, 1, True), ("chat", {}, 180.0, 1, True),
    ("multi-turn", {}, 180.0, 1, True))
# The precise index on the first of them, by KV-event delay (seconds).
KV_EVENT_DELAYS = (0.005, 0.03, 0.1, 0.3)


def points(trace: str) -> list[Point]:
    """Every point of the default sweep; ``trace`` is the conversation trace CSV."""
    profile = PROFILES[DEFAULT_PROFILE]
    result = []
    for name, rates in RATES.items():
        workload = WORKLOADS[name]
        if name == "trace":
            workload = msgspec.structs.replace(workload, trace=trace)
        for rate in rates:
            for label in POLICIES:
                result.append(
                    Point(
                        workload=workload,
                        **parse_policy(label).fields(),
                        rate=rate,
                        duration=DURATION,
                        seed=SEED,
                        profile=profile,
                    )
                )
    return result


def freshness_points() -> list[Point]:
    """The points of the freshness comparison."""
    return [
        Point(
            workload=WORKLOADS["chat"],
            **parse_policy(label).fields(),
            rate=FRESHNESS_RATE,
            duration=DURATION,
            seed=SEED,
            pickers=pickers,
            scrape_interval=interval,
        )
        for interval, pickers in FRESHNESS_VARIANTS
        for label in FRESHNESS_POLICIES
    ]


def replica_points() -> list[Point]:
    """The points of the replica comparison (``default`` policy)."""
    return [
        Point(
            workload=WORKLOADS[name],
            **parse_policy("default").fields(),
            rate=rate,
            duration=DURATION,
            seed=SEED,
            pickers=pickers,
            shared_decisions=shared,
            scrape_interval=interval,
        )
        for name, rate, interval in REPLICA_POINTS
        for pickers, shared in REPLICA_VARIANTS
    ]


def replica_table(results: Sequence[RunMetrics]) -> str:
    """TTFT by picker replicas, with and without shared decisions, against one picker."""
    lines = [
        "| workload | rate (req/s) | scrape interval | pickers | shared decisions | TTFT p50 "
        "| TTFT p90 | TTFT p99 | p90 / 1 picker | p99 / 1 picker |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    single: dict[tuple[str, float, float], RunMetrics] = {}
    for r in results:
        if r.pickers == 1:
            single[(r.workload, r.rate, r.scrape_interval)] = r
    for r in results:
        one = single.get((r.workload, r.rate, r.scrape_interval))
        shared = "yes" if r.shared_decisions else "no" if r.pickers > 1 else "-"
        lines.append(
            f"| {r.workload} | {r.rate:g} | {r.scrape_interval * 1000:g} ms | {r.pickers} "
            f"| {shared} | {report.format_seconds(r.ttft.p50)} "
            f"| {report.format_seconds(r.ttft.p90)} | {report.format_seconds(r.ttft.p99)} "
            f"| {_ratio(r.ttft.p90, one.ttft.p90 if one else None)} "
            f"| {_ratio(r.ttft.p99, one.ttft.p99 if one else None)} |"
        )
    return "\n".join(lines) + "\n"


def _ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}"


def prefix_fit_points() -> list[Point]:
    """The points of the shared-prefix comparison with prefixes that do not fit."""
    workload = msgspec.structs.replace(WORKLOADS["shared-prefix"], **PREFIX_FIT)
    return [
        Point(workload=workload, **parse_policy(label).fields(), rate=PREFIX_FIT_RATE,
              duration=DURATION, seed=SEED)
        for label in PREFIX_FIT_POLICIES
    ]


def prefix_source_points() -> list[Point]:
    """The points of the prefix-source comparison, then those of its event-delay table."""
    result: list[Point] = []
    for name, fields, rate, pickers, shared in PREFIX_SOURCE_POINTS:
        workload = msgspec.structs.replace(WORKLOADS[name], **fields, token_ids=True, chat=False)
        result.extend(Point(workload=workload, **parse_policy(label).fields(), rate=rate,
                            duration=DURATION, seed=SEED, pickers=pickers,
                            shared_decisions=shared)
                      for label in PREFIX_SOURCE_POLICIES)
    return result + kv_event_delay_points()


def kv_event_delay_points() -> list[Point]:
    """``default+precise`` on the first prefix-source workload at every :data:`KV_EVENT_DELAYS`."""
    name, fields, rate, _, _ = PREFIX_SOURCE_POINTS[0]
    workload = msgspec.structs.replace(WORKLOADS[name], **fields, token_ids=True, chat=False)
    return [Point(workload=workload, **parse_policy("default+precise").fields(), rate=rate,
                  duration=DURATION, seed=SEED, kv_event_delay=delay)
            for delay in KV_EVENT_DELAYS]


def prefix_source_table(results: Sequence[RunMetrics]) -> str:
    """TTFT and prefix-cache hits by prefix source, with TTFT p90 against the approximate
    index's (``default``) and the hit rate against the oracle's of the same source."""
    lines = [
        "| workload | rate (req/s) | pickers | policy | TTFT p50 | TTFT p90 | TTFT p99 "
        "| prefix hit | prompt tokens computed | p90 / default | hit / its +oracle |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_label = {(_setting(r), r.policy): r for r in results}
    for r in results:
        approximate = by_label.get((_setting(r), "default"))
        oracle = by_label.get((_setting(r), r.policy.removesuffix(ORACLE_SUFFIX) + ORACLE_SUFFIX))
        lines.append(
            f"| {r.workload} | {r.rate:g} | {_pickers(r)} | {r.policy} {_ttft_cells(r)} "
            f"| {r.prefix_cache_hit_rate:.1%} | {r.computed_prompt_tokens / 1e6:.2f} M "
            f"| {_ratio(r.ttft.p90, approximate.ttft.p90 if approximate else None)} "
            f"| {_ratio(r.prefix_cache_hit_rate, oracle.prefix_cache_hit_rate if oracle else None)}"
            " |"
        )
    return "\n".join(lines) + "\n"


def _ttft_cells(r: RunMetrics) -> str:
    """The TTFT p50, p90 and p99 cells of a row (seconds), each after its ``|``."""
    ttft = r.ttft
    return " ".join(f"| {report.format_seconds(value)}" for value in (ttft.p50, ttft.p90,
                                                                    ttft.p99))


def _setting(r: RunMetrics) -> tuple[str, float, int, bool]:
    """What a prefix-source comparison holds fixed: every row of one setting is one policy."""
    return (r.workload, r.rate, r.pickers, r.shared_decisions)


def _pickers(r: RunMetrics) -> str:
    """Picker replicas, and whether they shared decisions."""
    if r.pickers == 1:
        return "1"
    return f"{r.pickers}, {'shared' if r.shared_decisions else 'not shared'}"


def kv_event_delay_table(results: Sequence[RunMetrics]) -> str:
    """The precise index's TTFT and hits by KV-event delay."""
    lines = [
        "| KV-event delay | TTFT p50 | TTFT p90 | TTFT p99 | prefix hit |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.kv_event_delay * 1000:g} ms {_ttft_cells(r)} | {r.prefix_cache_hit_rate:.1%} |"
        )
    return "\n".join(lines) + "\n"


def prefix_source_blocks(results: Sequence[RunMetrics]) -> dict[str, str]:
    """The document's generated blocks of :func:`prefix_source_points`' results."""
    delays = len(KV_EVENT_DELAYS)
    return {"prefix-sources": prefix_source_table(results[:-delays]),
            "kv-event-delay": kv_event_delay_table(results[-delays:])}


def regenerate_prefix_sources(doc: Path, jobs: int) -> list[RunMetrics]:
    """Run only the prefix-source comparison and rewrite its blocks of ``doc``."""
    text = doc.read_text()
    results = run_points(prefix_source_points(), jobs=jobs)
    doc.write_text(replace_blocks(text, prefix_source_blocks(results)))
    return results


def freshness_table(results: Sequence[RunMetrics]) -> str:
    """Latencies by scrape interval and picker replicas (seconds)."""
    lines = [
        "| scrape interval | pickers | policy | TTFT p50 | TTFT p90 | TTFT p99 | ITL p99 |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.scrape_interval * 1000:g} ms | {r.pickers} | {r.policy} {_ttft_cells(r)} "
            f"| {report.format_seconds(r.itl.p99)} |"
        )
    return "\n".join(lines) + "\n"


_BLOCK = re.compile(r"(<!-- bench:(?P<name>[\w-]+) -->\n)(.*?)(<!-- /bench:(?P=name) -->)", re.S)


def replace_blocks(text: str, blocks: dict[str, str]) -> str:
    """``text`` with the content of each named block replaced; ValueError if one is missing."""
    present = {match.group("name") for match in _BLOCK.finditer(text)}
    missing = sorted(set(blocks) - present)
    if missing:
        raise ValueError(
            "the document lacks the generated blocks "
            + ", ".join(f"<!-- bench:{name} -->...<!-- /bench:{name} -->" for name in missing)
        )

    def substitute(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in blocks:
            return match.group(0)
        return match.group(1) + blocks[name] + match.group(4)

    return _BLOCK.sub(substitute, text)


def regenerate(doc: Path, trace: str, command: Sequence[str], jobs: int) -> list[RunMetrics]:
    """Run the default sweep and rewrite ``doc``'s generated blocks and plots."""
    text = doc.read_text()
    groups = [points(trace), freshness_points(), replica_points(), prefix_fit_points(),
              prefix_source_points()]
    everything = run_points([point for group in groups for point in group], jobs=jobs)
    parts = []
    for group in groups:
        parts.append(everything[: len(group)])
        everything = everything[len(group):]
    results, freshness, replicas, prefix_fit, prefix_sources = parts
    image_dir = doc.parent / doc.stem
    blocks = {
        "setup": _setup_block(command),
        "freshness": freshness_table(freshness),
        "replicas": replica_table(replicas),
        "prefix-fit": report.markdown_table(prefix_fit),
        **prefix_source_blocks(prefix_sources),
    }
    for name in RATES:
        runs = [r for r in results if r.workload == name]
        image = image_dir / f"{name}.png"
        report.plot(runs, f"{name}: 8 pods, {DEFAULT_PROFILE}", image)
        table = report.markdown_table(runs)
        if report.has_mixed_criticality(runs):
            table += "\nBy criticality (shed / requests of that class; TTFT in s):\n\n"
            table += report.criticality_table(runs)
        relative = image.relative_to(doc.parent).as_posix()
        blocks[name] = f"![{name}]({relative})\n\n{table}"
    doc.write_text(replace_blocks(text, blocks))
    return results


def _setup_block(command: Sequence[str]) -> str:
    profile = PROFILES[DEFAULT_PROFILE]
    engine = engine_config(WORKLOADS["chat"], profile)
    lora = engine_config(WORKLOADS["multi-lora"], profile)
    point = Point(workload=WORKLOADS["chat"], policy=PolicyConfig(), rate=1, duration=DURATION)
    lines = [
        "```",
        " ".join(shlex.quote(part) for part in command),
        "```",
        "",
        f"- Fleet: {point.pods} pods, {point.pickers} picker, metrics scraped every "
        f"{point.scrape_interval * 1000:g} ms and seen by the picker "
        f"{point.propagation_delay * 1000:g} ms later.",
        f"- Each point: {DURATION:g} s of arrivals (seed {SEED}), run until every request ended; "
        f"policies {', '.join(POLICIES)} with default parameters. The picker's load "
        "estimate is on (the requests it sent to a pod since that pod's newest snapshot, beyond "
        "the least-served pod's, count as waiting; `services/picker/load_estimate.py`), except "
        "for names ending in `+raw` (`lig picker --no-load-estimate`, as upstream).",
        f"- Simulator profile `{profile.name}`: step = {profile.b0 * 1e3:g} ms + "
        f"{profile.b1 * 1e6:g} µs/prefill token + {profile.b2 * 1e6:g} µs/decode token + "
        f"{profile.b3 * 1e9:g} ns/context token; {profile.num_gpu_blocks} KV blocks of "
        f"{profile.block_size} tokens; adapter load {profile.lora_load_cpu_s * 1e3:g} ms from "
        f"CPU, {profile.lora_load_disk_s * 1e3:g} ms from disk; no jitter"
        + ("." if not profile.jitter else f" (jitter {profile.jitter:g})."),
        f"- vLLM settings: max_num_seqs {engine.max_num_seqs}, max_num_batched_tokens "
        f"{engine.max_num_batched_tokens}, prefix caching "
        f"{'on' if engine.enable_prefix_caching else 'off'}; multi-LoRA: max_loras "
        f"{lora.max_loras}, max_cpu_loras {lora.max_cpu_loras}.",
        "- Workloads: "
        + "; ".join(f"`{name}`: {WORKLOADS[name].description}" for name in RATES)
        + ".",
    ]
    return "\n".join(lines) + "\n"
