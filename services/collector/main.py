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
from typing import Annotated

import msgspec
from nats.aio.client import Client
from nats.js.client import KV_STREAM_TEMPLATE

from services.collector.membership import HeartbeatSubjects, Membership, default_member_id
from services.collector.observability import CollectorMetrics
from services.collector.ownership import owned_by
from services.collector.pod_loop import Cadence, run_pod_loop
from services.collector.publisher import SnapshotPublisher
from services.collector.recording import (
    DECISIONS_MAX_BYTES,
    METRICS_MAX_BYTES,
    REGISTRY_MAX_BYTES,
    StreamBytes,
    keep_stream,
    recording_configs,
)
from services.collector.scrape_supervisor import ScrapeSupervisor
from services.collector.scraper import Scraper
from services.collector.targets import ScrapeTarget, targets_from_view
from shared import ports
from shared.host.lifespan import Lifespan
from shared.host.settings import add_flags, from_args, option
from shared.logs import LogLevel, setup_logging
from shared.nats_connection import NatsSettings, connection
from shared.registry_view import RegistryView, RegistryWatcher
from shared.replication import warn_about_replication, watch_replicas
from shared.service import run_service
from shared.subjects import Subjects

log = logging.getLogger("lig.collector")

MIN_INTERVAL_S = 0.005
SHUTDOWN_TIMEOUT_S = 1.0


class CollectorSettings(msgspec.Struct, frozen=True):
    """Everything ``lig collector`` is configured with: one field per flag."""

    nats: NatsSettings = NatsSettings()
    collector_id: Annotated[str, option("this collector's name among its peers", min_length=1,
                                        default_text="HOSTNAME-PID")] \
        = msgspec.field(default_factory=default_member_id)
    interval_s: Annotated[float, option("seconds between two scrapes of a pod",
                                        flag="--interval", ge=MIN_INTERVAL_S)] = 0.05
    scrape_timeout_s: Annotated[float | None, option(
        "seconds one scrape may take; must be below --interval (default: 0.8 x interval)",
        flag="--scrape-timeout", gt=0)] = None
    max_backoff_s: Annotated[float, option(
        "longest wait, in seconds, between scrapes of a failing pod",
        flag="--max-backoff", gt=0)] = 1.0
    heartbeat_s: Annotated[float, option(
        "seconds between heartbeats; a dead collector's pods move to the others within two "
        "heartbeats", flag="--heartbeat", gt=0)] = 1.0
    record_max_age_s: Annotated[float, option(
        "seconds of snapshots, decisions and registry changes the recording streams keep; 0 "
        "disables recording",
        flag="--record-max-age", ge=0)] = 3600.0
    record_max_bytes: Annotated[int, option(
        "bytes of snapshots the LIG_METRICS stream keeps; the oldest go first when this or "
        "--record-max-age is reached", gt=0)] = METRICS_MAX_BYTES
    record_decisions_max_bytes: Annotated[int, option(
        "bytes of picker decisions the LIG_DECISIONS stream keeps (same age limit); registry "
        f"changes (LIG_REGISTRY) keep {REGISTRY_MAX_BYTES} bytes", gt=0)] = DECISIONS_MAX_BYTES
    host: Annotated[str, option("address the metrics endpoint listens on")] = "0.0.0.0"
    metrics_port: Annotated[int, option(
        "port of this collector's own Prometheus metrics; 0 disables", ge=0)] \
        = ports.COLLECTOR_METRICS
    log_level: LogLevel = "INFO"

    def __post_init__(self) -> None:
        # The bounds of single fields are their annotations; this checks the fields together.
        if not 0 < self.timeout_s < self.interval_s:
            raise ValueError("--scrape-timeout (env LIG_SCRAPE_TIMEOUT) must be above 0 and "
                             "below --interval (env LIG_INTERVAL)")

    @property
    def timeout_s(self) -> float:
        """The scrape timeout: ``--scrape-timeout``, else 0.8 x ``--interval``."""
        return self.scrape_timeout_s if self.scrape_timeout_s is not None \
            else 0.8 * self.interval_s


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the collector's flags (one per :class:`CollectorSettings` field)."""
    add_flags(parser, CollectorSettings)


def settings_from(args: argparse.Namespace) -> CollectorSettings:
    """Validated settings: flags, else ``LIG_*`` variables, else defaults; ConfigError (a
    ValueError) names the bad flag."""
    settings: CollectorSettings = from_args(CollectorSettings, args)
    return settings


def run(args: argparse.Namespace) -> int:
    """Run the collector until SIGTERM/SIGINT."""
    settings = settings_from(args)
    setup_logging("collector", settings.log_level)
    # httpx logs every request at INFO: 20 lines a second per pod.
    logging.getLogger("httpx").setLevel(logging.WARNING)
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
        self.scraper = Scraper(settings.timeout_s, f"lig-collector/{settings.collector_id}",
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
        async with Lifespan() as life:
            life.on_close(self.scraper.aclose, within=SHUTDOWN_TIMEOUT_S)
            life.metrics_server(settings.host, settings.metrics_port, self.metrics.prometheus)
            # Drained on the way out: the last snapshots and the goodbye heartbeat go out.
            nc = await life.enter(connection(
                settings.nats, f"lig-collector {settings.collector_id}", stop,
                on_reconnect=self._reconnected, on_disconnect=self._disconnected,
                drain=True, close_within=SHUTDOWN_TIMEOUT_S))
            if nc is not None:
                self._start(nc, stop, life)
                await stop.wait()
        log.info("collector %s stopped", settings.collector_id)
        return 0

    def _start(self, nc: Client, stop: asyncio.Event, life: Lifespan) -> None:
        settings = self.settings
        self._nc, self._stop = nc, stop
        warn_about_replication(nc, settings.nats.replicas, "collector")
        self.publisher = SnapshotPublisher(nc, self.metrics)
        self.membership = Membership(
            nc, HeartbeatSubjects(self.subjects.collector_heartbeat,
                                  self.subjects.all_collector_heartbeats()),
            settings.collector_id, settings.heartbeat_s, self.rebalance,
            on_undecodable=lambda: self.metrics.undecodable.labels("heartbeat").inc())
        self.watcher = RegistryWatcher(
            nc.jetstream(), self.subjects.registry_bucket, self.view, on_change=self.rebalance,
            on_undecodable=lambda key, exc: self.metrics.undecodable.labels("registry").inc())
        life.callback(self._stop_recording)
        self._start_recording(nc)
        # Copies of the stack's streams, for the alert on a cluster that lost a node.
        streams = [*(str(c.name) for c in recording_configs(self.subjects, 1.0)),
                   KV_STREAM_TEMPLATE.format(bucket=self.subjects.registry_bucket)]
        life.task(watch_replicas(nc.jetstream(), streams, self._count_replicas, stop),
                  finish=SHUTDOWN_TIMEOUT_S)
        # Membership announces that this collector leaves, so peers take over at once.
        life.task(self.membership.run(stop), finish=SHUTDOWN_TIMEOUT_S)
        life.task(self.watcher.run(stop), finish=SHUTDOWN_TIMEOUT_S)
        life.on_close(self.scrape_supervisor.stop, within=SHUTDOWN_TIMEOUT_S)
        log.info("collector %s ready: scraping every %g s (timeout %g s), metrics on %s, "
                 "nats %s", settings.collector_id, settings.interval_s, settings.timeout_s,
                 f"{settings.host}:{settings.metrics_port}" if settings.metrics_port else "off",
                 settings.nats.url)

    def _count_replicas(self, stream: str, configured: int, current: int) -> None:
        self.metrics.stream_replicas.labels(stream, "configured").set(configured)
        self.metrics.stream_replicas.labels(stream, "current").set(current)

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

    def _start_recording(self, nc: Client) -> None:
        if self.settings.record_max_age_s <= 0:
            return
        if self._recording is not None:
            self._recording.cancel()
        self._recording = asyncio.create_task(keep_stream(
            nc.jetstream(), self.subjects, self.settings.record_max_age_s, self._stop,
            replicas=self.settings.nats.replicas,
            max_bytes=StreamBytes(self.settings.record_max_bytes,
                                  self.settings.record_decisions_max_bytes)))

    def _stop_recording(self) -> None:
        if self._recording is not None:
            self._recording.cancel()

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
