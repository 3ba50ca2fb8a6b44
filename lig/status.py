"""``lig status``: every pool (its pods and models), the pods of every pool with their latest
metrics and freshness, and the pickers' request counts, from NATS (and the pickers' Prometheus
endpoints).

Pods and their addresses come from the registry's KV bucket. Each pod's latest snapshot is the
newest one recorded in the metrics stream (so a pod whose collector died shows its growing age),
or, when recording is disabled, the newest one seen on the metrics subjects during ``--window``.
Picker counts are scraped from the pickers' ``/metrics``: the URLs given with
``--picker-metrics``, else those of the running ``lig up`` stack (its ``stack.json`` in the state
folder) when the NATS and prefix read are the stack's. Pickers do not announce their metrics
endpoints on NATS, so a stack's pickers pointed at another NATS are not this fleet's: they are
left out, and the table says so and why.

Exit code: 0 when every pod is fresh, 1 when one is not (or there are none), 2 when NATS or the
registry cannot be read.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import httpx
import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError
from prometheus_client.parser import text_string_to_metric_families

from lig.topology import DEFAULT_STATE_DIR, StackInfo
from shared.logs import setup_logging
from shared.nats_connection import (
    NatsSettings,
    add_nats_arguments,
    connect,
    nats_url_given,
    settings_from_args,
)
from shared.registry_view import RegistryView, RegistryWatcher
from shared.schemas import DecodeError, PodMetrics, decode
from shared.subjects import Subjects
from shared.waits import within

EXIT_ALL_FRESH = 0
EXIT_NOT_FRESH = 1
EXIT_UNREACHABLE = 2

# The picker's request counter (services/picker): one sample per model, target, pod and outcome.
PICKER_REQUESTS_FAMILY = "lig_picker_requests"


class PodRow(msgspec.Struct, frozen=True):
    """One pod of the table."""

    pool: str
    pod: str
    address: str
    state: str  # fresh | stale | failing | no data
    age_s: float | None = None
    waiting: int | None = None
    running: int | None = None
    kv_cache_usage: float | None = None
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    max_lora: int | None = None
    error: str | None = None


class PoolRow(msgspec.Struct, frozen=True):
    """One pool of the registry: its member pods, how many are fresh, its model names."""

    pool: str
    pods: int
    fresh: int
    models: list[str]


class PickerRow(msgspec.Struct, frozen=True):
    """One picker's request counts by outcome (``routed``, ``429``...), or why they are unknown."""

    url: str
    requests: dict[str, int] = {}
    error: str | None = None


class PickerSource(msgspec.Struct, frozen=True):
    """The pickers' metrics endpoints to scrape, where they come from, and why a running
    stack's pickers are not among them (None: they are, or there is no stack)."""

    urls: list[str]
    origin: str = ""  # "--picker-metrics" or "the lig up stack in DIR"; "" when none
    left_out: str | None = None


class Report(msgspec.Struct, frozen=True):
    """Everything ``lig status`` shows."""

    nats_url: str
    stale_after_s: float
    pods: list[PodRow]
    pickers: list[PickerRow]
    pools: list[PoolRow] = []
    pickers_from: str = ""  # PickerSource.origin
    pickers_left_out: str | None = None  # PickerSource.left_out

    def all_fresh(self) -> bool:
        return bool(self.pods) and all(row.state == "fresh" for row in self.pods)


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the status command's flags."""
    # Without an explicit URL (flag or LIG_NATS_URL), the running `lig up` stack's NATS is used.
    add_nats_arguments(parser)
    parser.add_argument("--state-dir", type=Path, default=Path(DEFAULT_STATE_DIR),
                        help="state folder of a running `lig up`, read for its NATS URL and "
                             "picker metrics endpoints")
    parser.add_argument("--picker-metrics", action="append", metavar="URL", default=None,
                        help="a picker's Prometheus endpoint (repeatable); default: those of "
                             "the running `lig up` stack when its NATS and prefix are the ones "
                             "read")
    parser.add_argument("--stale-after", type=float, default=1.0,
                        help="seconds after which a pod's latest snapshot counts as stale "
                             "(the pickers' --stale-after)")
    parser.add_argument("--window", type=float, default=1.5,
                        help="seconds to listen for snapshots when the metrics stream is absent")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for NATS and the registry")
    parser.add_argument("--watch", type=float, default=0.0, metavar="SECONDS",
                        help="redraw every SECONDS until Ctrl-C (0: print once)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Print the status once (or repeatedly with ``--watch``)."""
    stack = StackInfo.read(args.state_dir)
    if stack is not None and not _pid_alive(stack.pid):
        stack = None  # left behind by a `lig up` that was killed
    settings, pickers = apply_stack_defaults(args, stack)
    setup_logging("status", "ERROR")  # the table says what matters; no reconnect chatter
    try:
        return asyncio.run(_run(args, settings, pickers))
    except KeyboardInterrupt:
        return EXIT_ALL_FRESH


def apply_stack_defaults(args: argparse.Namespace, stack: StackInfo | None
                         ) -> tuple[NatsSettings, PickerSource]:
    """The NATS settings and the pickers to scrape, from the flags, else the running stack.

    Without ``--nats-url`` (or ``LIG_NATS_URL``) the stack's NATS and prefix are used, else the
    default NATS URL. Without ``--picker-metrics``, the stack's pickers when the NATS URL and
    prefix are the stack's (they belong to the fleet read), else none, saying why.
    """
    settings = settings_from_args(args)
    explicit = nats_url_given(args) or bool(os.environ.get("LIG_NATS_URL"))
    if stack is not None and not explicit:
        settings = msgspec.structs.replace(
            settings, url=stack.nats_url,
            prefix=stack.prefix if settings.prefix == Subjects().prefix else settings.prefix)
    if args.picker_metrics is not None:
        return settings, PickerSource(args.picker_metrics, "--picker-metrics")
    if stack is None:
        return settings, PickerSource([])
    where = f"the lig up stack in {args.state_dir}"
    if (settings.url, settings.prefix) == (stack.nats_url, stack.prefix):
        return settings, PickerSource(stack.picker_metrics, where)
    return settings, PickerSource([], left_out=(
        f"The pickers of {where} are not listed: they use NATS {stack.nats_url} "
        f"(prefix {stack.prefix}), not the one read here; give this fleet's with "
        "--picker-metrics URL."))


async def _run(args: argparse.Namespace, settings: NatsSettings, pickers: PickerSource) -> int:
    try:
        nc = await within(connect(settings, "lig-status"), args.timeout)
    except (TimeoutError, OSError) as exc:
        print(f"lig status: cannot reach NATS at {settings.url}: {exc or 'timed out'}",
              file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        while True:
            try:
                report = await collect(nc, settings, pickers, args.stale_after, args.window,
                                       args.timeout)
            except TimeoutError as exc:
                print(f"lig status: {exc}", file=sys.stderr)
                return EXIT_UNREACHABLE
            if args.json:
                print(msgspec.json.encode(report).decode(), flush=True)
            else:
                if args.watch:
                    print("\x1b[H\x1b[2J", end="")
                print(render(report), flush=True)
            if not args.watch:
                return EXIT_ALL_FRESH if report.all_fresh() else EXIT_NOT_FRESH
            await asyncio.sleep(args.watch)
    finally:
        with contextlib.suppress(Exception):
            await within(nc.close(), 1.0)


async def collect(nc: Client, settings: NatsSettings, pickers: PickerSource,
                  stale_after: float, window: float, registry_wait: float) -> Report:
    """Read the registry, each pod's latest snapshot and the pickers' counts."""
    subjects = Subjects(settings.prefix)
    view = await read_registry(nc, subjects, registry_wait)
    members = [(pool, endpoint) for pool, endpoint_set in sorted(view.endpoints.items())
               for endpoint in endpoint_set.endpoints]
    latest = await latest_snapshots(nc, subjects, [(pool, e.name) for pool, e in members], window)
    now_ns = time.time_ns()
    rows = [pod_row(pool, endpoint.name, endpoint.hostport, latest.get((pool, endpoint.name)),
                    now_ns, stale_after) for pool, endpoint in members]
    async with httpx.AsyncClient(timeout=2.0) as client:
        counts = await asyncio.gather(*(scrape_picker(client, url) for url in pickers.urls))
    return Report(settings.url, stale_after, rows, list(counts), pool_rows(view, rows),
                  pickers_from=pickers.origin, pickers_left_out=pickers.left_out)


def pool_rows(view: RegistryView, pods: list[PodRow]) -> list[PoolRow]:
    """One row per pool the registry names (by its pool, endpoints or models), by name."""
    names = sorted(view.pools.keys() | view.endpoints.keys()
                   | {pool for pool, models in view.models.items() if models})
    return [PoolRow(name, sum(row.pool == name for row in pods),
                    sum(row.pool == name and row.state == "fresh" for row in pods),
                    sorted(view.models.get(name, {}))) for name in names]


async def read_registry(nc: Client, subjects: Subjects, wait: float) -> RegistryView:
    """The registry as currently published (waits up to ``wait`` seconds for the bucket)."""
    stop = asyncio.Event()
    watcher = RegistryWatcher(nc.jetstream(), subjects.registry_bucket, RegistryView(),
                              retry_interval=0.2)
    task = asyncio.create_task(watcher.run(stop))
    try:
        await within(watcher.synced.wait(), wait)
    except TimeoutError:
        raise TimeoutError(f"no registry bucket {subjects.registry_bucket} within {wait}s: "
                           "is a registry running against this NATS?") from None
    finally:
        stop.set()
        await task
    return watcher.view


async def latest_snapshots(nc: Client, subjects: Subjects, pods: list[tuple[str, str]],
                           window: float) -> dict[tuple[str, str], PodMetrics]:
    """The newest snapshot of each ``(pool, pod)``: recorded in the stream, else heard live."""
    js = nc.jetstream()
    latest: dict[tuple[str, str], PodMetrics] = {}
    try:
        await js.stream_info(subjects.metrics_stream)
    except NotFoundError:
        recorded = False  # recording is disabled: listen instead
    else:
        recorded = True
    if recorded:
        for pool, pod in pods:
            with contextlib.suppress(NotFoundError, DecodeError):
                message = await js.get_last_msg(subjects.metrics_stream,
                                                subjects.metrics(pool, pod))
                latest[(pool, pod)] = decode(message.data or b"", PodMetrics)
        return latest

    async def keep_newest(message: Msg) -> None:
        with contextlib.suppress(DecodeError):
            snapshot = decode(message.data, PodMetrics)
            key = (snapshot.pool, snapshot.pod)
            if key not in latest or latest[key].scrape_time_ns < snapshot.scrape_time_ns:
                latest[key] = snapshot

    subscription = await nc.subscribe(subjects.all_metrics(), cb=keep_newest)
    await asyncio.sleep(window)
    await subscription.unsubscribe()
    return latest


def pod_row(pool: str, pod: str, address: str, snapshot: PodMetrics | None, now_ns: int,
            stale_after: float) -> PodRow:
    """A table row for one pod from its latest snapshot (None: never scraped)."""
    if snapshot is None:
        return PodRow(pool, pod, address, "no data")
    age = max(0.0, (now_ns - snapshot.scrape_time_ns) / 1e9)
    if not snapshot.ok:  # a failed scrape's metric fields are zeros, not measurements
        return PodRow(pool, pod, address, "failing", age_s=age, error=snapshot.error)
    state = "stale" if age > stale_after else "fresh"
    return PodRow(pool, pod, address, state, age_s=age, waiting=snapshot.waiting,
                  running=snapshot.running, kv_cache_usage=snapshot.kv_cache_usage,
                  running_adapters=snapshot.running_adapters,
                  waiting_adapters=snapshot.waiting_adapters, max_lora=snapshot.max_lora)


def request_counts(page: str) -> dict[str, int]:
    """The picker's requests by outcome, summed over models and pods, from its metrics page."""
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(page):
        if family.name != PICKER_REQUESTS_FAMILY:
            continue
        for sample in family.samples:
            if sample.name == f"{PICKER_REQUESTS_FAMILY}_total":
                outcome = sample.labels.get("outcome", "?")
                counts[outcome] = counts.get(outcome, 0) + int(sample.value)
    return counts


async def scrape_picker(client: httpx.AsyncClient, url: str) -> PickerRow:
    """One picker's counts, or the reason they could not be read."""
    try:
        response = await client.get(url)
        response.raise_for_status()
        return PickerRow(url, request_counts(response.text))
    except (httpx.HTTPError, ValueError) as exc:
        return PickerRow(url, error=str(exc) or type(exc).__name__)


def _cell(value: object) -> str:
    return "-" if value is None or value == () else str(value)


def _table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    rows = [header, *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in rows]


def render(report: Report) -> str:
    """The human-readable tables."""
    fresh = sum(row.state == "fresh" for row in report.pods)
    lines = [f"NATS {report.nats_url}: {len(report.pools)} pools, {len(report.pods)} pods, "
             f"{fresh} fresh (snapshot younger than {report.stale_after_s:g}s)", ""]
    if report.pools:
        lines += _table(["POOL", "PODS", "FRESH", "MODELS"],
                        ([row.pool, str(row.pods), str(row.fresh), ", ".join(row.models) or "-"]
                         for row in report.pools))
        lines.append("")
    if report.pods:
        lines += _table(
            ["POOL", "POD", "ADDRESS", "STATE", "AGE", "WAITING", "RUNNING", "KV", "ADAPTERS",
             "WAITING ADAPTERS", "MAX LORA"],
            ([row.pool, row.pod, row.address,
              row.state if row.error is None else f"{row.state}: {row.error}",
              "-" if row.age_s is None else f"{row.age_s:.2f}s",
              _cell(row.waiting), _cell(row.running),
              "-" if row.kv_cache_usage is None else f"{100 * row.kv_cache_usage:.0f}%",
              ",".join(row.running_adapters) or "-", ",".join(row.waiting_adapters) or "-",
              _cell(row.max_lora)] for row in report.pods),
        )
    else:
        lines.append("no pods in the registry")
    if report.pickers_left_out is not None:
        lines += ["", report.pickers_left_out]
    if report.pickers:
        outcomes = sorted({o for p in report.pickers for o in p.requests},
                          key=lambda o: (o != "routed", o))
        lines.append("")
        if report.pickers_from:
            lines.append(f"Pickers from {report.pickers_from}:")
        lines += _table(
            ["PICKER", "REQUESTS", *[o.upper() for o in outcomes]],
            ([p.url, "-" if p.error else str(sum(p.requests.values())),
              *[str(p.requests.get(o, 0)) for o in outcomes]]
             if p.error is None else [p.url, f"unreachable: {p.error}", *["-"] * len(outcomes)]
             for p in report.pickers),
        )
    return "\n".join(lines)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
