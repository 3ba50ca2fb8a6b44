"""Run benchmark points: one workload, policy and rate each, in parallel worker processes.

A point is plain data, so it travels to a worker process; its result does not depend on which
process runs it or in what order (every random stream is seeded from the point).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import TypedDict

import msgspec

from scheduling.profile import PREFIX_AWARE
from scheduling_bench.fleet import DEFAULT_KV_EVENT_DELAY, FleetConfig, PrefixSource, simulate
from scheduling_bench.results import RunMetrics, summarize
from scheduling_bench.workloads import Workload, adapter_names, generate
from shared.schemas import PolicyConfig
from simulator.engine import EngineConfig
from simulator.profiles import DEFAULT_PROFILE, PROFILES, Profile

RAW_SUFFIX = "+raw"
"""A policy name ending in this runs without the pickers' load estimate, on the scraped metrics
alone (``lig picker --no-load-estimate``, upstream's behaviour): ``filter-tree+raw``."""
ORACLE_SUFFIX = "+oracle"
"""A policy name ending in this decides on every pod's exact state at decision time (no scrape
delay): ``default+oracle``, the bound no real picker can beat."""
DEFAULT_POLICY = "default"
"""The policy name meaning whatever ``lig picker`` runs when its pool names no policy."""
PRECISE_SUFFIX = "+precise"
"""A policy name ending in this takes its prefix matches from the pods' KV-cache events (the
precise prefix index, ``FleetConfig.prefix`` "precise") instead of the approximate index:
``default+precise``. Needs a workload that sends token ids (``token_ids``)."""
NO_PREFIX_SUFFIX = "+no-prefix"
"""A policy name ending in this runs without any prefix index (``--prefix-index-entries 0``):
``default+no-prefix``, the same policy blind to prefixes."""
_PREFIX_SUFFIXES: dict[str, PrefixSource] = {PRECISE_SUFFIX: "precise", NO_PREFIX_SUFFIX: "none"}


class Point(msgspec.Struct, frozen=True):
    """One run: a workload at a rate for a duration, through a fleet under one policy."""

    workload: Workload
    policy: PolicyConfig
    rate: float
    duration: float
    seed: int = 1
    pods: int = 8
    pickers: int = 1
    scrape_interval: float = 0.05
    propagation_delay: float = 0.005
    profile: Profile = PROFILES[DEFAULT_PROFILE]
    load_estimate: bool = True
    oracle: bool = False
    shared_decisions: bool = True
    decision_delay: float = 0.002
    alias: str | None = None
    """The name the policy was asked by (``default``), when not its own."""
    prefix: PrefixSource = "approximate"
    kv_event_delay: float = DEFAULT_KV_EVENT_DELAY
    speculative_ttl: float | None = None
    """``lig picker --speculative-ttl`` (None: its default)."""

    @property
    def label(self) -> str:
        """The policy as results name it: its name (or alias), with ``+raw`` when the estimate
        is off, ``+precise`` / ``+no-prefix`` for its prefix source and ``+oracle`` when it
        decides on exact state."""
        source = next((suffix for suffix, prefix in _PREFIX_SUFFIXES.items()
                       if prefix == self.prefix), "")
        return ((self.alias or self.policy.name) + ("" if self.load_estimate else RAW_SUFFIX)
                + source + (ORACLE_SUFFIX if self.oracle else ""))


class PolicyFields(TypedDict):
    """The :class:`Point` fields a policy label sets (typed, for ``Point(**fields)``)."""

    policy: PolicyConfig
    load_estimate: bool
    oracle: bool
    alias: str | None
    prefix: PrefixSource


class PolicyChoice(msgspec.Struct, frozen=True):
    """A policy label read: the configuration and how the pickers run it."""

    policy: PolicyConfig
    load_estimate: bool = True
    oracle: bool = False
    alias: str | None = None
    prefix: PrefixSource = "approximate"

    def fields(self) -> PolicyFields:
        """The :class:`Point` fields this choice sets."""
        return PolicyFields(policy=self.policy, load_estimate=self.load_estimate,
                            oracle=self.oracle, alias=self.alias, prefix=self.prefix)


def parse_policy(label: str) -> PolicyChoice:
    """``filter-tree`` -> its default config; ``+raw`` turns the estimate off, ``+oracle`` gives
    exact state, ``+precise`` / ``+no-prefix`` pick the prefix source (in any order; ValueError
    for both); ``default`` is the picker's default policy (``PolicyConfig()``)."""
    name, raw, oracle = label, False, False
    prefix: PrefixSource | None = None
    suffixes = (RAW_SUFFIX, ORACLE_SUFFIX, *_PREFIX_SUFFIXES)
    while name.endswith(suffixes):
        suffix = next(suffix for suffix in suffixes if name.endswith(suffix))
        name = name.removesuffix(suffix)
        if suffix == RAW_SUFFIX:
            raw = True
        elif suffix == ORACLE_SUFFIX:
            oracle = True
        elif prefix is not None and prefix != _PREFIX_SUFFIXES[suffix]:
            raise ValueError(f"{label}: {PRECISE_SUFFIX} and {NO_PREFIX_SUFFIX} exclude each other")
        else:
            prefix = _PREFIX_SUFFIXES[suffix]
    source: PrefixSource = prefix or "approximate"
    if name == DEFAULT_POLICY:
        return PolicyChoice(PolicyConfig(), not raw, oracle, DEFAULT_POLICY, source)
    return PolicyChoice(PolicyConfig(name=name), not raw, oracle, prefix=source)


def with_scorer_weight(plugin: str, weight: float) -> PolicyConfig:
    """``prefix-aware`` with the default profile but the scorer ``plugin`` at ``weight`` (for
    the weight studies in bench/)."""
    params = msgspec.to_builtins(PREFIX_AWARE)
    scorers = [scorer for scorer in params["scorers"] if scorer["plugin"] == plugin]
    if not scorers:
        raise ValueError(f"the prefix-aware profile has no scorer {plugin!r}")
    for scorer in scorers:
        scorer["weight"] = weight
    return PolicyConfig("prefix-aware", params)


def engine_config(workload: Workload, profile: Profile) -> EngineConfig:
    """The vLLM settings of every pod: the profile, and the workload's adapters and slots."""
    adapters = adapter_names(workload.adapters)
    return EngineConfig(
        profile=profile,
        adapters=adapters,
        max_loras=workload.max_loras,
        max_cpu_loras=workload.max_cpu_loras or max(len(adapters), workload.max_loras),
    )


def run_point(point: Point) -> RunMetrics:
    """Generate the point's requests, play them through the fleet, and summarize."""
    requests = generate(point.workload, point.rate, point.duration, point.seed)
    config = FleetConfig(
        pods=point.pods,
        pickers=point.pickers,
        scrape_interval=point.scrape_interval,
        propagation_delay=point.propagation_delay,
        load_estimate=point.load_estimate,
        oracle=point.oracle,
        shared_decisions=point.shared_decisions,
        decision_delay=point.decision_delay,
        prefix=point.prefix,
        kv_event_delay=point.kv_event_delay,
        speculative_ttl=point.speculative_ttl,
        engine=engine_config(point.workload, point.profile),
    )
    run = simulate(requests, point.policy, config, point.seed)
    return summarize(
        run,
        workload=point.workload.name,
        policy=point.label,
        rate=point.rate,
        duration=point.duration,
        pickers=point.pickers,
        scrape_interval=point.scrape_interval,
        propagation_delay=point.propagation_delay,
        seed=point.seed,
        decision_delay=point.decision_delay,
        kv_event_delay=point.kv_event_delay if point.prefix == "precise" and not point.oracle
        else 0.0,
    )


def run_points(points: Sequence[Point], jobs: int = 1, progress: bool = True) -> list[RunMetrics]:
    """Results of ``points``, in their order; ``jobs`` > 1 runs them in worker processes.

    Equal points run once (a sweep may list a point twice, e.g. as part of two comparisons).
    """
    keys = [msgspec.json.encode(point) for point in points]
    unique = {key: point for key, point in zip(keys, points, strict=True)}
    done: dict[bytes, RunMetrics] = {}
    if jobs <= 1 or len(unique) <= 1:
        for key, point in unique.items():
            done[key] = run_point(point)
            if progress:
                _report(len(done), len(unique), done[key])
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            # Longest first (most requests), so that no long run starts last and idles a core.
            order = sorted(unique, key=lambda key: -unique[key].rate * unique[key].duration)
            futures = {pool.submit(run_point, unique[key]): key for key in order}
            for future in as_completed(futures):
                done[futures[future]] = future.result()
                if progress:
                    _report(len(done), len(unique), done[futures[future]])
    return [done[key] for key in keys]


def _report(done: int, total: int, result: RunMetrics) -> None:
    print(
        f"[{done}/{total}] {result.workload} {result.policy} {result.rate:g} req/s: "
        f"{result.requests} requests, {result.wall_seconds:.1f} s wall",
        file=sys.stderr,
        flush=True,
    )
