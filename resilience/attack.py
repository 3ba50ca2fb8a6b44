"""The attack run: each scenario against a running stack, under client traffic, as figures.

Scenarios (``--only`` picks some): ``flood`` (both pickers at once, while requests go through
Envoy), ``amplification``, ``buffering``, ``slow``, ``control`` (on the first picker) and
``http`` (through Envoy). Targets come from issue 13: a PING answered within 1 s, under 20 MiB
of RSS growth (partial messages: no more than one connection's buffer cap, which must hold one
message of the largest size Envoy sends), under 1% of requests through Envoy failing, every bad
request answered with a status and an OpenAI-shaped error, slow and flooding connections closed
by the picker. A
baseline (the same probes and load, no attack) comes first, for comparison within the same run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import msgspec

from protocols.http2_limits import MIB, Http2Limits
from resilience import attacks, bad_http
from resilience import h2wire as w
from resilience.h2wire import PingProbe, ping_once
from resilience.load import LoadRun, steady_load
from resilience.report import Figure
from resilience.stack import Picker, Target
from services.picker.app import MAX_MESSAGE_BYTES

SCENARIOS = ("flood", "amplification", "buffering", "slow", "control", "http")
PING_TARGET_S = 1.0
RSS_TARGET_MB = 20.0
FAILED_TARGET_PCT = 1.0
SETTLE_S = 20.0
BASELINE_S = 3.0


class AttackSettings(msgspec.Struct, frozen=True):
    """How hard and how long each scenario attacks (every loop is bounded by both)."""

    scenarios: tuple[str, ...] = SCENARIOS
    duration: float = 10.0  # seconds of each HTTP/2 scenario
    rate: float = 50.0  # requests/s through Envoy during the HTTP/2 scenarios
    streams: int = 10_000
    settings_frames: int = 10
    amplification_frames: int = 5_000
    amplification_seconds: float = 30.0  # the picker may take this long to answer them all
    header_frames: int = 5
    partial_streams: int = 12  # each gets 8 MiB of a message that claims 60 MiB
    control_frames: int = 50_000
    slow_connections: int = 100
    # Seconds each slow connection is held before the closed ones are counted: beyond the
    # picker's preface timeout, which a connection must outlive to be closed by it.
    slow_hold: float = Http2Limits().preface_timeout + 2.0
    request_timeout: float = 20.0


def _ping_figure(scenario: str, picker: Picker, probe: PingProbe) -> Figure:
    worst = probe.worst
    shown = f"{worst:.2f} s" if worst < probe.timeout else f">= {probe.timeout:g} s (no answer)"
    return Figure(scenario, f"{picker.name} PING answered within",
                  f"{shown} (median {probe.median * 1000:.1f} ms, {len(probe.rtts)} pings"
                  + (f", {probe.failures} failed" if probe.failures else "") + ")",
                  f"< {PING_TARGET_S:g} s", bool(probe.rtts) and worst < PING_TARGET_S)


def _failed_figure(scenario: str, run: LoadRun) -> Figure:
    total = len(run.outcomes)
    lost = LoadRun.lost(run.outcomes)
    pct = 100.0 * len(lost) / total if total else 0.0
    causes = LoadRun.causes(lost)
    return Figure(scenario, "requests through Envoy failed",
                  f"{pct:.1f}% ({len(lost)}/{total} at {LoadRun.achieved_rate(run.outcomes):.0f}"
                  f" req/s{'; ' + causes if causes else ''})",
                  f"< {FAILED_TARGET_PCT:g}%", total > 0 and pct < FAILED_TARGET_PCT)


def _rss_figure(scenario: str, picker: Picker, growth_mb: float | None,
                target_mb: float = RSS_TARGET_MB) -> Figure:
    if growth_mb is None:
        return Figure(scenario, f"{picker.name} RSS growth", "unknown (pid not visible)",
                      f"< {target_mb:g} MiB")
    return Figure(scenario, f"{picker.name} RSS growth", f"{growth_mb:.1f} MiB",
                  f"< {target_mb:g} MiB", growth_mb < target_mb)


@contextlib.asynccontextmanager
async def _under_load(target: Target, settings: AttackSettings, pickers: tuple[Picker, ...],
                      run: LoadRun, seconds: float) -> AsyncIterator[list[PingProbe]]:
    """PING probes on ``pickers`` while the block runs, and ``seconds`` of steady requests
    through Envoy from its start."""
    async with contextlib.AsyncExitStack() as stack:
        probes = [await stack.enter_async_context(attacks.probing(p)) for p in pickers]
        load = asyncio.create_task(steady_load(target.gateway, settings.rate, seconds, run,
                                               settings.request_timeout))
        try:
            yield probes
        finally:
            for probe in probes:
                await probe.stop()
            await load


async def stream_flood(target: Target, settings: AttackSettings) -> list[Figure]:
    """Both pickers flooded at once while requests go through Envoy."""
    run = LoadRun()
    async with _under_load(target, settings, target.pickers, run, settings.duration) as probes:
        results = await asyncio.gather(*(
            attacks.stream_flood(p, settings.streams, settings.settings_frames,
                                 settings.duration) for p in target.pickers))
    figures = []
    for picker, probe, result in zip(target.pickers, probes, results, strict=True):
        figures.append(_ping_figure("stream flood", picker, probe))
        figures.append(Figure("stream flood", f"{picker.name} streams opened / refused",
                              f"{result.opened} / {result.refused}, "
                              f"{result.settings_sent} SETTINGS"
                              + (", GOAWAY" if result.goaway else "")))
        if result.cpu_s is not None:
            figures.append(Figure("stream flood", f"{picker.name} CPU used",
                                  f"{result.cpu_s:.1f} s in {settings.duration:g} s"))
    figures.append(_failed_figure("stream flood", run))
    return figures


async def amplification(target: Target, settings: AttackSettings) -> list[Figure]:
    """The first picker gets the HPACK amplification; answers are never read."""
    picker = target.pickers[0]
    run = LoadRun()
    async with _under_load(target, settings, (picker,), run,
                                 settings.amplification_seconds) as probes:
        result = await attacks.amplification(picker, settings.amplification_frames,
                                             settings.amplification_seconds)
    return [
        _rss_figure("amplification", picker, result.rss_growth_mb),
        _ping_figure("amplification", picker, probes[0]),
        Figure("amplification", "sent", f"{result.units_sent} HEADERS frames, "
                                         f"{result.bytes_sent / 1024:.0f} KiB"),
        _failed_figure("amplification", run),
    ]


async def buffering(target: Target, settings: AttackSettings) -> list[Figure]:
    """Huge header blocks, then never-completed messages, each on its own connection to the
    first picker, answers unread."""
    picker = target.pickers[0]
    figures = []
    # Partial messages may fill one connection's buffer: it must hold one message of the
    # largest size Envoy sends, so the target is that cap (plus the allocator's slack), not 20.
    held_mb = Http2Limits().buffered_cap(MAX_MESSAGE_BYTES) / MIB * 1.1
    floods = (("huge header block", attacks.table_size_updates, settings.header_frames,
               "1 MiB HEADERS frames", RSS_TARGET_MB),
              ("partial messages", attacks.partial_message_chunk,
               settings.partial_streams * attacks.PARTIAL_CHUNKS, "1 MiB frames", held_mb))
    for name, unit, count, unit_name, rss_target_mb in floods:
        run = LoadRun()
        async with _under_load(target, settings, (picker,), run, settings.duration) as probes:
            result = await attacks.write_flood(picker, w.PREFACE + w.settings(), unit, count,
                                               settings.duration, batch_units=1)
        figures += [
            Figure(name, "sent", f"{result.units_sent} {unit_name}"
                                 + (", then closed by the picker" if result.closed_by_server
                                    else "")),
            _rss_figure(name, picker, result.rss_growth_mb, round(rss_target_mb)),
            _ping_figure(name, picker, probes[0]),
            _failed_figure(name, run),
        ]
    return figures


async def slow(target: Target, settings: AttackSettings) -> list[Figure]:
    """Connections that send nothing or half a preface, each held ``slow_hold`` seconds."""
    picker = target.pickers[0]
    run = LoadRun()
    held = settings.slow_hold
    async with _under_load(target, settings, (picker,), run, held) as probes:
        result = await attacks.slow_peers(picker, settings.slow_connections, held)
    within = f"within {held:g} s"
    return [
        Figure("slow peers", f"silent connections closed {within}",
               f"{result.idle_closed}/{result.idle}", "all",
               result.idle > 0 and result.idle_closed == result.idle),
        Figure("slow peers", f"half-preface connections closed {within}",
               f"{result.partial_closed}/{result.partial}", "all",
               result.partial > 0 and result.partial_closed == result.partial),
        Figure("slow peers", "connections not accepted", f"{result.refused}"),
        _ping_figure("slow peers", picker, probes[0]),
        _failed_figure("slow peers", run),
    ]


async def control(target: Target, settings: AttackSettings) -> list[Figure]:
    """Each control-frame flood on its own connection to the first picker, answers unread."""
    picker = target.pickers[0]
    figures = []
    for name, flood in attacks.CONTROL_FLOODS.items():
        run = LoadRun()
        async with _under_load(target, settings, (picker,), run, settings.duration) as probes:
            result = await attacks.write_flood(picker, flood.opening, flood.unit,
                                               settings.control_frames, settings.duration)
        figures += [
            Figure(name, "connection closed by the picker",
                   f"{'yes' if result.closed_by_server else 'no'} "
                   f"(after {result.units_sent} {flood.unit_name} sent)", "yes",
                   result.closed_by_server),
            _rss_figure(name, picker, result.rss_growth_mb),
            _ping_figure(name, picker, probes[0]),
            _failed_figure(name, run),
        ]
    return figures


async def bad_requests(target: Target, settings: AttackSettings) -> list[Figure]:
    """Every malformed request case through Envoy."""
    url = httpx.URL(target.gateway)
    results = await bad_http.run_cases(url.host, url.port or 80)
    return [Figure("bad HTTP", name, shown, "status + OpenAI JSON, no 5xx", passed)
            for name, passed, shown, _ in results]


async def baseline(target: Target, settings: AttackSettings) -> list[Figure]:
    """The same probes and load with no attack: what the figures under attack compare to."""
    seconds = min(settings.duration, BASELINE_S)
    run = LoadRun()
    async with _under_load(target, settings, target.pickers, run, seconds) as probes:
        await asyncio.sleep(seconds)
    figures = []
    for picker, probe in zip(target.pickers, probes, strict=True):
        figure = _ping_figure("baseline", picker, probe)
        figures.append(msgspec.structs.replace(figure, target="", passed=None))
    failed = _failed_figure("baseline", run)
    return [*figures, msgspec.structs.replace(failed, target="", passed=None)]


RUNNERS = {"flood": stream_flood, "amplification": amplification, "buffering": buffering,
           "slow": slow,
           "control": control, "http": bad_requests}


async def run_attacks(current: Callable[[], Target], settings: AttackSettings,
                      recover: Callable[[Picker], Awaitable[None]] | None = None,
                      ) -> list[Figure]:
    """A baseline, then every chosen scenario, one after the other, each on ``current()``
    (pids change when a picker is restarted). A picker that does not answer a PING within
    ``SETTLE_S`` after a scenario is reported, then handed to ``recover`` (a started stack
    restarts it) so that the next scenario measures a fresh picker rather than the previous
    one's aftermath."""
    figures = await baseline(current(), settings)
    for scenario in settings.scenarios:
        target = current()
        try:
            figures += await RUNNERS[scenario](target, settings)
        except (OSError, TimeoutError) as exc:  # e.g. a picker too busy to accept a connection
            figures.append(Figure(scenario, "scenario completed",
                                  f"{type(exc).__name__}: {exc!s:.60}", "yes", False))
        for picker in target.pickers:
            if await ping_once(picker.host, picker.port, SETTLE_S) is None:
                action = "restarted" if recover is not None else "left as is"
                figures.append(Figure(scenario, f"{picker.name} answers again afterwards",
                                      f"not within {SETTLE_S:g} s ({action})", "yes", False))
                if recover is not None:
                    await recover(picker)
    return figures
