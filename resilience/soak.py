"""The soak: picker memory under unique long prompts (issue 26's third target).

For ``seconds`` s, ``rate`` completions a second go through Envoy, each with a prompt of
``prompt_tokens`` tokens that shares nothing with any other, not even its first KV block
(:func:`resilience.load.unique_prompt`), and asks for one token: the prompts are the point.
The stack is the chaos tool's, with KV events, so both of each picker's prefix indexes fill:
the approximate one (1 KiB prefix hashes, bounded by ``--prefix-index-entries``) from every
routed prompt, the precise one (token blocks, bounded by ``--precise-blocks``) from the pods'
KV events, which announce every new prompt's blocks and remove those the pods evict.

Every picker's resident memory is sampled every second. Target (issue 26): over the last third
of the run, its peak at most 2% above its value when that third began; an index that kept
growing with the prompts would show there. The index sizes at the end show that they filled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import msgspec

from resilience.chaos import lost_figures
from resilience.load import UNIQUE, UNIQUE_PROMPT_TOKENS, LoadRun, steady_load
from resilience.picker_metrics import picker_samples
from resilience.procinfo import rss_bytes
from resilience.report import Figure
from resilience.stack import OwnedStack
from services.picker.routing import DEFAULT_PRECISE_BLOCKS, DEFAULT_PREFIX_ENTRIES

GROWTH_TARGET_PCT = 2.0  # issue 26: +2% at most over the last third of the soak
SAMPLE_EVERY = 1.0  # seconds between RSS samples
MIN_PROMPT_TOKENS = 16  # a simulated pod's KV block: a shorter prompt fills no precise index
SIM_ARGS = "--time-scale 10"
"""The soak stack's pods run ten times faster than real time: an 8,000-token prefill takes
about 0.14 s at 1x, so 4 pods would serve about 28 prompts a second, and the soak's queueing
would be theirs, not the pickers'."""
INDEX_SAMPLES = {
    "lig_picker_precise_blocks": "precise",
    "lig_picker_precise_blocks_evicted_total": "evicted",
    "lig_picker_prefix_index_entries": "approximate",
}
"""The picker metrics read at the end (summed over its pools), by the name used here."""

Samples = list[tuple[float, int]]  # (seconds since the start, resident bytes)


class SoakSettings(msgspec.Struct, frozen=True):
    """How long, how fast, how long the prompts, and the pickers' index bounds."""

    seconds: float = 120.0
    # Unique prompts a second through Envoy: at 30 the approximate index reaches its default
    # bound (65,536) after about 58 s, before the last third that is judged starts.
    rate: float = 30.0
    prompt_tokens: int = UNIQUE_PROMPT_TOKENS
    request_timeout: float = 20.0
    precise_blocks: int = DEFAULT_PRECISE_BLOCKS  # lig picker --precise-blocks
    prefix_index_entries: int = DEFAULT_PREFIX_ENTRIES  # lig picker --prefix-index-entries

    def picker_args(self) -> tuple[str, ...]:
        """The ``lig picker`` flags of the bounds."""
        return ("--precise-blocks", str(self.precise_blocks),
                "--prefix-index-entries", str(self.prefix_index_entries))


def last_third(samples: Sequence[tuple[float, int]]) -> list[int]:
    """The resident bytes sampled from the start of the last third of ``samples``' time span
    on."""
    if not samples:
        return []
    first, last = samples[0][0], samples[-1][0]
    cut = first + (last - first) * 2 / 3
    return [rss for at, rss in samples if at >= cut]


def growth_pct(tail: Sequence[int]) -> float | None:
    """How far the peak of ``tail`` is above its first value, in percent; None without two
    values (or with a first of 0 bytes)."""
    if len(tail) < 2 or tail[0] <= 0:
        return None
    return 100.0 * (max(tail) - tail[0]) / tail[0]


async def _sample_rss(pids: dict[str, int | None], seconds: float) -> dict[str, Samples]:
    """Each picker's resident bytes every ``SAMPLE_EVERY`` s for ``seconds`` s (a picker that is
    gone gets no sample)."""
    samples: dict[str, Samples] = {name: [] for name in pids}
    begin = time.monotonic()
    for tick in range(int(seconds / SAMPLE_EVERY) + 1):
        await asyncio.sleep(max(0.0, begin + tick * SAMPLE_EVERY - time.monotonic()))
        at = time.monotonic() - begin
        for name, pid in pids.items():
            rss = rss_bytes(pid) if pid else None
            if rss is not None:
                samples[name].append((at, rss))
    return samples


async def index_sizes(url: str) -> dict[str, int] | None:
    """A picker's index sizes from its ``/metrics`` (:data:`INDEX_SAMPLES`, summed over its
    pools); None when it cannot be read."""
    samples = await picker_samples(url)
    if samples is None:
        return None
    sizes = dict.fromkeys(INDEX_SAMPLES.values(), 0)
    for sample in samples:
        if sample.name in INDEX_SAMPLES:
            sizes[INDEX_SAMPLES[sample.name]] += int(sample.value)
    return sizes


def _mib(value: float) -> str:
    """``value`` bytes in MiB, one decimal."""
    return f"{value / (1 << 20):.1f} MiB"


def memory_figures(picker: str, samples: Samples, seconds: float) -> list[Figure]:
    """One picker's RSS at the start and the end (context), and its growth over the last third
    against the target."""
    if not samples:
        return [Figure("soak", f"{picker} RSS", "unreadable", "readable", False)]
    peak = max(rss for _, rss in samples)
    tail = last_third(samples)
    growth = growth_pct(tail)
    target = f"<= +{GROWTH_TARGET_PCT:g}%"
    third = f"{picker} RSS growth over the last third ({seconds / 3:.0f} s)"
    return [
        Figure("soak", f"{picker} RSS at the start -> at the end",
               f"{_mib(samples[0][1])} -> {_mib(samples[-1][1])} (peak {_mib(peak)}, "
               f"{len(samples)} samples)"),
        Figure("soak", third, "too few samples", target, False) if growth is None else
        Figure("soak", third, f"{growth:+.1f}% ({_mib(tail[0])} -> peak {_mib(max(tail))})",
               target, growth <= GROWTH_TARGET_PCT),
    ]


def index_figure(picker: str, sizes: dict[str, int] | None, settings: SoakSettings) -> Figure:
    """One picker's index sizes at the end (context: they show that the indexes filled)."""
    if sizes is None:
        return Figure("soak", f"{picker} indexes at the end", "metrics unreadable")
    return Figure("soak", f"{picker} indexes at the end",
                  f"precise {sizes['precise']} blocks (bound {settings.precise_blocks} a pool, "
                  f"{sizes['evicted']} evicted), approximate {sizes['approximate']} entries "
                  f"(bound {settings.prefix_index_entries} a pool)")


async def run_soak(stack: OwnedStack, settings: SoakSettings) -> list[Figure]:
    """The soak on a ready stack: the load and the RSS sampling side by side, then the figures."""
    pickers = stack.target.pickers
    run = LoadRun()
    load = asyncio.create_task(steady_load(
        stack.target.gateway, settings.rate, settings.seconds, run, settings.request_timeout,
        UNIQUE, settings.prompt_tokens))
    samples = await _sample_rss({p.name: p.pid for p in pickers}, settings.seconds)
    await load
    figures = [Figure("soak", "unique prompts sent",
                      f"{len(run.outcomes)} in {settings.seconds:g} s, "
                      f"{settings.prompt_tokens} tokens each"),
               *lost_figures("soak", run.outcomes)]
    for picker in pickers:
        figures += memory_figures(picker.name, samples[picker.name], settings.seconds)
        figures.append(index_figure(
            picker.name, await index_sizes(picker.metrics_url) if picker.metrics_url else None,
            settings))
    died = stack.unexpected_exit()
    if died is not None:
        figures.append(Figure("soak", "no service died", died.splitlines()[0], "none", False))
    return figures
