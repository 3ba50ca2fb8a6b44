"""``lig collector``: scrape the registry's pods and publish a snapshot per scrape on NATS.

Wiring only: the registry watcher and the collectors' membership both trigger
:meth:`Collector.rebalance`, which hands the pods this collector owns to the supervisor; each
owned pod runs a scrape loop that publishes every snapshot.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import socket

import msgspec
from nats.aio.client import Client

from services.collector.membership import Membership
from services.collector.observability import CollectorMetrics, serve_metrics
from services.collector.ownership import owned_by
from services.collector.pod_loop import Cadence, run_pod_loop
from services.collector.publisher import SnapshotPublisher
from services.collector.recording import keep_stream
from services.collector.scrape_supervisor import ScrapeSupervisor
from services.collector.scraper import Scraper
from services.collector.targets import ScrapeTarget, targets_from_view
from shared.logs import add_logging_arguments, setup_logging
from shared.nats_connection import NatsSettings, add_nats_arguments, connect, settings_from_args
from shared.registry_view import RegistryView, RegistryWatcher
from shared.replication import warn_about_replication
from shared.service import cancel_and_wait, finish_within, run_service
from shared.subjects import Subjects

log = logging.getLogger("lig.collector")

MIN_INTERVAL_S = 0.005
SHUTDOWN_TIMEOUT_S = 1.0


class CollectorSettings(msgspec.Struct, frozen=True):
    """Everything ``lig collector`` is configured with."""

    nats: NatsSettings
    collector_id: str
    interval_s: float = 0.05
    scrape_timeout_s: float = 0.04
    max_backoff_s: float = 1.0
    heartbeat_s: float = 1.0
    record_max_age_s: float = 3600.0
    host: str = "0.0.0.0"
    metrics_port: int = 9091


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the collector's flags."""
    parser.add_argument("--interval", type=float, default=0.05,
                        help="seconds between two scrapes of a pod")
    parser.add_argument("--scrape-timeout", type=float, default=None,
                        help="seconds one scrape may take; must be below --interval "
                             "(default: 0.8 x interval)")
    parser.add_argument("--max-backoff", type=float, default=1.0,
                        help="longest wait, in seconds, between scrapes of a failing pod")
    parser.add_argument("--heartbeat", type=float, default=1.0,
                        help="seconds between heartbeats; a dead collector's pods move to the "
                             "others within two heartbeats")
    parser.add_argument("--record-max-age", type=float, default=3600.0,
                        help="seconds of snapshots the LIG_METRICS stream keeps; 0 disables "
                             "recording")
    parser.add_argument("--collector-id", default=f"{socket.gethostname()}-{os.getpid()}",
                        help="this collector's name among its peers")
    parser.add_argument("--host", default=os.environ.get("LIG_HOST", "0.0.0.0"),
                        help="address the metrics endpoint listens on (env LIG_HOST)")
    parser.add_argument("--metrics-port", type=int, default=9091,
                        help="port of this collector's own Prometheus metrics; 0 disables")
    add_nats_arguments(parser)
    add_logging_arguments(parser)


def settings_from(args: argparse.Namespace) -> CollectorSettings:
    """Validated settings from parsed flags; ValueError names the bad flag."""
    if args.interval < MIN_INTERVAL_S:
        raise ValueError(f"--interval must be at least {MIN_INTERVAL_S} s")
    timeout = args.scrape_timeout if args.scrape_timeout is not None else 0.8 * args.interval
    if not 0 < timeout < args.interval:
        raise ValueError("--scrape-timeout must be above 0 and below --interval")
    if args.heartbeat <= 0 or args.max_backoff <= 0 or args.record_max_age < 0:
        raise ValueError("--heartbeat and --max-backoff must be > 0, --record-max-age >= 0")
    return CollectorSettings(
        nats=settings_from_args(args), collector_id=args.collector_id,
        interval_s=args.interval, scrape_timeout_s=timeout, max_backoff_s=args.max_backoff,
        heartbeat_s=args.heartbeat, record_max_age_s=args.record_max_age, host=args.host,
        metrics_port=args.metrics_port,
    )


def run(args: argparse.Namespace) -> int:
    """Run the collector until SIGTERM/SIGINT."""
    setup_logging("collector", args.log_level)
    # httpx logs every request at INFO: 20 lines a second per pod.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        settings = settings_from(args)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    # Everything imported so far lives as long as the process: keep the garbage collector from
    # rescanning it. A full collection over it took ~50 ms, which shows up as latency spikes.
    gc.freeze()
    return run_service(lambda stop: Collector(settings).run(stop))


class Collector:
    """One collector process: its parts, and what happens on registry or membership changes."""

    def __init__(self, settings: CollectorSettings) -> None:
        self.settings = settings
        self.subjects = Subjects(settings.nats.prefix)
        self.metrics = CollectorMetrics()
        self.view = RegistryView()
        self.scraper = Scraper(settings.scrape_timeout_s, f"lig-collector/{settings.collector_id}",
                               self.metrics)
        self.cadence = Cadence(settings.interval_s, settings.max_backoff_s)
        self.scrape_supervisor = ScrapeSupervisor(self._scrape_loop, stopped=self.scraper.close)
        # Set once NATS is connected (see run).
        self.publisher: SnapshotPublisher | None = None
        self.membership: Membership | None = None
        self.watcher: RegistryWatcher | None = None
        self._nc: Client | None = None
        self._stop = asyncio.Event()
        self._recording: asyncio.Task[None] | None = None

    async def run(self, stop: asyncio.Event) -> int:
        """Serve metrics, connect, work until ``stop`` is set, then leave cleanly."""
        settings = self.settings
        stop_metrics_server = None
        if settings.metrics_port:
            try:
                stop_metrics_server = serve_metrics(self.metrics, settings.host,
                                                    settings.metrics_port)
            except OSError as exc:
                log.error("cannot serve metrics on %s:%d: %s", settings.host,
                          settings.metrics_port, exc)
                return 1
        try:
            nc = await self._connect(stop)
            if nc is not None:
                await self._work(nc, stop)
        finally:
            await self.scraper.aclose()
            if stop_metrics_server is not None:
                stop_metrics_server()
            log.info("collector %s stopped", settings.collector_id)
        return 0

    async def _work(self, nc: Client, stop: asyncio.Event) -> None:
        settings = self.settings
        self._nc, self._stop = nc, stop
        warn_about_replication(nc, settings.nats.replicas, "collector")
        self.publisher = SnapshotPublisher(nc, self.metrics)
        self.membership = Membership(nc, self.subjects, settings.collector_id,
                                     settings.heartbeat_s, self.metrics, self.rebalance)
        self.watcher = RegistryWatcher(
            nc.jetstream(), self.subjects.registry_bucket, self.view, on_change=self.rebalance,
            on_undecodable=lambda key, exc: self.metrics.undecodable.labels("registry").inc())
        self._start_recording(nc)
        tasks = [asyncio.create_task(self.membership.run(stop)),
                 asyncio.create_task(self.watcher.run(stop))]
        log.info("collector %s ready: scraping every %g s (timeout %g s), metrics on %s, "
                 "nats %s", settings.collector_id, settings.interval_s, settings.scrape_timeout_s,
                 f"{settings.host}:{settings.metrics_port}" if settings.metrics_port else "off",
                 settings.nats.url)
        try:
            await stop.wait()
        finally:
            await self.scrape_supervisor.stop()
            # Membership announces that this collector leaves, so peers take over at once.
            await finish_within(asyncio.gather(*tasks, return_exceptions=True),
                                SHUTDOWN_TIMEOUT_S)
            if self._recording is not None:
                self._recording.cancel()
            await finish_within(nc.drain(), SHUTDOWN_TIMEOUT_S)

    def rebalance(self) -> None:
        """Scrape exactly the pods this collector owns now."""
        if self.membership is None:
            return
        targets = targets_from_view(self.view, self.subjects)
        members = self.membership.members()
        wanted = owned_by(self.settings.collector_id, targets, members) \
            if self.membership.active else {}
        before = len(self.scrape_supervisor.targets)
        self.scrape_supervisor.reconcile(wanted)
        self.metrics.pods_known.set(len(targets))
        self.metrics.pods_owned.set(len(wanted))
        self.metrics.live_collectors.set(len(members))
        if len(wanted) != before:
            log.info("scraping %d of %d pods (%d collectors)", len(wanted), len(targets),
                     len(members))

    async def _scrape_loop(self, target: ScrapeTarget) -> None:
        assert self.publisher is not None
        await run_pod_loop(target, self.scraper, self.publisher, self.cadence)

    async def _connect(self, stop: asyncio.Event) -> Client | None:
        """Connect to NATS (retrying forever), unless ``stop`` comes first."""
        connecting = asyncio.create_task(connect(
            self.settings.nats, f"lig-collector {self.settings.collector_id}",
            on_reconnect=self._reconnected, on_disconnect=self._disconnected))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([connecting, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not connecting.done():
            await cancel_and_wait(connecting)  # nats-py's connect may swallow one cancel
            return None
        return connecting.result()

    def _start_recording(self, nc: Client) -> None:
        if self.settings.record_max_age_s <= 0:
            return
        if self._recording is not None:
            self._recording.cancel()
        self._recording = asyncio.create_task(keep_stream(
            nc.jetstream(), self.subjects, self.settings.record_max_age_s, self._stop,
            replicas=self.settings.nats.replicas))

    async def _reconnected(self) -> None:
        if self.watcher is not None:
            self.watcher.resync()
        if self.membership is not None:
            await self.membership.reconnected()
        if self._nc is not None:
            self._start_recording(self._nc)

    async def _disconnected(self) -> None:
        if self.membership is not None:
            self.membership.disconnected()
