"""``lig kv-events``: subscribe to every pod's vLLM KV-cache events, republish block changes.

A service beside the collector rather than inside it: it holds one long-lived ZMQ connection per
pod (the collector holds none), its failure modes (a flood, a stuck replay, a decoder bug) must
not delay metric snapshots, and a fleet without events does not run it at all. Pods come from
the registry; ``--shards``/``--shard`` split them between replicas by the collector's
rendezvous hashing. Wiring only: :class:`~services.kvevents.pod_stream.PodStream` does the work.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from collections.abc import Coroutine
from typing import Any

import msgspec
import zmq.asyncio
from nats.aio.client import Client
from prometheus_client import start_http_server

from services.kvevents.observability import KVEventsMetrics
from services.kvevents.pod_stream import PodEndpoints, PodStream, StreamSettings
from services.kvevents.recording import stream_config, try_ensure_stream
from services.kvevents.targets import PortSpec, parse_port, pods_from_view
from shared import ports
from shared.kv_blocks import KVBlockChanges, encode
from shared.kv_events import KVEventDecoder, Limits
from shared.logs import add_logging_arguments, setup_logging
from shared.nats_connection import NatsSettings, add_nats_arguments, connect, settings_from_args
from shared.registry_view import RegistryView, RegistryWatcher
from shared.service import cancel_and_wait, finish_within, run_service
from shared.subjects import Subjects

log = logging.getLogger("lig.kv_events")

SHUTDOWN_TIMEOUT_S = 1.0


class KVEventsSettings(msgspec.Struct, frozen=True):
    """Everything ``lig kv-events`` is configured with."""

    nats: NatsSettings
    events_port: PortSpec = PortSpec(ports.KV_EVENTS)
    replay_port: PortSpec | None = PortSpec(ports.KV_EVENTS_REPLAY)
    shard: int = 0
    shards: int = 1
    dp_ranks: int = 1
    stream: StreamSettings = StreamSettings()
    limits: Limits = Limits()
    record_max_age_s: float = 3600.0
    record_max_bytes: int = 1 << 30
    host: str = "0.0.0.0"
    metrics_port: int = ports.KV_EVENTS_METRICS


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``lig kv-events``."""
    parser.add_argument("--events-port", default=str(ports.KV_EVENTS),
                        help="each pod's KV-event PUB port: N, or +N/-N relative to the port "
                             "the pod serves on (several pods on one host, as with lig sim)")
    parser.add_argument("--replay-port", default=str(ports.KV_EVENTS_REPLAY),
                        help="each pod's replay ROUTER port, same forms; 'none': no replay "
                             "(every gap then becomes a resync marker)")
    parser.add_argument("--dp-ranks", type=int, default=1,
                        help="data-parallel ranks per pod: rank r publishes on both ports + r "
                             "(as vLLM does), each with its own sequence")
    parser.add_argument("--shards", type=int, default=1,
                        help="replicas sharing the pods (rendezvous hashing on pool/pod)")
    parser.add_argument("--shard", type=int, default=0, help="this replica's number, 0-based")
    parser.add_argument("--replay-timeout", type=float, default=2.0,
                        help="seconds to wait for each frame of a replay before giving up")
    parser.add_argument("--max-message-bytes", type=int, default=Limits().max_message_bytes,
                        help="larger event messages are skipped (counted)")
    parser.add_argument("--record-max-age", type=float, default=3600.0,
                        help="seconds of block changes the LIG_KVBLOCKS stream keeps; 0 disables "
                             "recording")
    parser.add_argument("--record-max-bytes", type=int, default=1 << 30,
                        help="bytes the LIG_KVBLOCKS stream keeps at most (oldest dropped)")
    parser.add_argument("--host", default=os.environ.get("LIG_HOST", "0.0.0.0"),
                        help="address the metrics endpoint listens on (env LIG_HOST)")
    parser.add_argument("--metrics-port", type=int, default=ports.KV_EVENTS_METRICS,
                        help="port of this service's Prometheus metrics; 0 disables")
    add_nats_arguments(parser)
    add_logging_arguments(parser)


def settings_from(args: argparse.Namespace) -> KVEventsSettings:
    """Validated settings from parsed flags; ValueError names the bad flag."""
    if args.shards < 1 or not 0 <= args.shard < args.shards:
        raise ValueError("--shards must be >= 1 and --shard in 0..--shards-1")
    if not 1 <= args.dp_ranks <= 1024:
        raise ValueError("--dp-ranks must be in 1..1024")
    if args.replay_timeout <= 0 or args.max_message_bytes < 64:
        raise ValueError("--replay-timeout must be > 0 and --max-message-bytes >= 64")
    if args.record_max_age < 0 or args.record_max_bytes < 1:
        raise ValueError("--record-max-age must be >= 0 and --record-max-bytes >= 1")
    replay = None if args.replay_port.lower() == "none" \
        else parse_port(args.replay_port, "--replay-port")
    return KVEventsSettings(
        nats=settings_from_args(args), events_port=parse_port(args.events_port, "--events-port"),
        replay_port=replay, shard=args.shard, shards=args.shards, dp_ranks=args.dp_ranks,
        stream=StreamSettings(replay_timeout_s=args.replay_timeout),
        limits=Limits(max_message_bytes=args.max_message_bytes),
        record_max_age_s=args.record_max_age, record_max_bytes=args.record_max_bytes,
        host=args.host, metrics_port=args.metrics_port)


def run(args: argparse.Namespace) -> int:
    """Run until SIGTERM/SIGINT."""
    setup_logging("kv-events", args.log_level)
    try:
        settings = settings_from(args)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    return run_service(lambda stop: KVEventsService(settings).run(stop))


class KVEventsService:
    """The pods' streams, started and stopped as the registry changes."""

    def __init__(self, settings: KVEventsSettings) -> None:
        self.settings = settings
        self.subjects = Subjects(settings.nats.prefix)
        self.metrics = KVEventsMetrics()
        self.view = RegistryView()
        self.decoder = KVEventDecoder(settings.limits,
                                      lambda reason: self.metrics.skipped.labels(reason).inc())
        self.streams: dict[str, tuple[PodEndpoints, asyncio.Task[None]]] = {}
        self._ctx = zmq.asyncio.Context()
        self._nc: Client | None = None
        self._watcher: RegistryWatcher | None = None
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> int:
        """Serve metrics, connect, work until ``stop`` is set, then stop within a second or so."""
        settings = self.settings
        server = None
        if settings.metrics_port:
            try:
                server, thread = start_http_server(settings.metrics_port, addr=settings.host,
                                                   registry=self.metrics.prometheus)
            except OSError as exc:
                log.error("cannot serve metrics on %s:%d: %s", settings.host,
                          settings.metrics_port, exc)
                return 1
        try:
            connecting = asyncio.create_task(connect(settings.nats, "lig-kv-events",
                                                     on_reconnect=self._reconnected))
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait([connecting, stopping], return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not connecting.done():
                await cancel_and_wait(connecting)
                return 0
            await self._work(connecting.result(), stop)
        finally:
            await self._stop_tasks([task for _, task in self.streams.values()])
            self._ctx.term()
            if server is not None:
                server.shutdown()
                server.server_close()
                thread.join(timeout=1)
            log.info("kv-events stopped")
        return 0

    async def _work(self, nc: Client, stop: asyncio.Event) -> None:
        self._nc, self._stop = nc, stop
        self._watcher = watcher = RegistryWatcher(
            nc.jetstream(), self.subjects.registry_bucket, self.view, on_change=self.reconcile,
            on_undecodable=lambda key, exc: self.metrics.skipped.labels("registry").inc())
        recording = asyncio.create_task(self._keep_recording(nc, stop))
        watching = asyncio.create_task(watcher.run(stop))
        log.info("kv-events ready: events port %s, replay port %s, %d rank(s) per pod, "
                 "shard %d of %d, nats %s", _show(self.settings.events_port),
                 _show(self.settings.replay_port), self.settings.dp_ranks, self.settings.shard,
                 self.settings.shards, self.settings.nats.url)
        try:
            await stop.wait()
        finally:
            recording.cancel()
            await finish_within(asyncio.gather(watching, recording, return_exceptions=True),
                                SHUTDOWN_TIMEOUT_S)
            await self._stop_tasks([task for _, task in self.streams.values()])
            await finish_within(nc.drain(), SHUTDOWN_TIMEOUT_S)

    def reconcile(self) -> None:
        """Subscribe to exactly the pods this shard owns now (a pod whose address or ports
        changed gets a fresh stream)."""
        settings = self.settings
        wanted = pods_from_view(self.view, settings.events_port, settings.replay_port,
                                settings.shard, settings.shards, settings.dp_ranks)
        gone = [key for key, (pod, _) in self.streams.items() if wanted.get(key) != pod]
        if gone:
            self._background(self._stop_tasks([self.streams.pop(key)[1] for key in gone]))
        for key, pod in wanted.items():
            if key not in self.streams:
                stream = PodStream(pod, self._ctx, self.decoder, self._publish, settings.stream,
                                   self._count)
                task = asyncio.create_task(self._run_stream(stream), name=f"kv-events {key}")
                self.streams[key] = (pod, task)
        self.metrics.pods.set(len(self.streams))

    def _count(self, outcome: str, n: int) -> None:
        self.metrics.batches.labels(outcome).inc(n)

    async def _run_stream(self, stream: PodStream) -> None:
        """One pod's stream; a bug in it is logged and the stream restarted, others go on."""
        while True:
            try:
                await stream.run()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s/%s: event stream failed; restarting it", stream.pod.pool,
                              stream.pod.pod)
                await asyncio.sleep(1.0)

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in a task kept until it ends (the loop only keeps weak references)."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stop_tasks(self, tasks: list[asyncio.Task[None]]) -> None:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=SHUTDOWN_TIMEOUT_S)

    async def _publish(self, changes: KVBlockChanges) -> None:
        nc = self._nc
        if changes.resync:
            self.metrics.resyncs.inc()
        if nc is None or not nc.is_connected:
            self.metrics.publish_errors.inc()
            return
        try:
            await nc.publish(self.subjects.kv_blocks(changes.pool, changes.pod), encode(changes))
        except Exception as exc:  # a failed publish is counted, never fatal
            self.metrics.publish_errors.inc()
            log.warning("cannot publish block changes of %s/%s: %s", changes.pool, changes.pod,
                        exc)
            return
        self.metrics.published.inc()

    async def _keep_recording(self, nc: Client, stop: asyncio.Event) -> None:
        settings = self.settings
        if settings.record_max_age_s <= 0:
            return
        wanted = stream_config(self.subjects, settings.record_max_age_s,
                               settings.record_max_bytes, settings.nats.replicas)
        while not stop.is_set() and not await try_ensure_stream(nc.jetstream(), wanted):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    async def _reconnected(self) -> None:
        if self._watcher is not None:
            self._watcher.resync()
        # A restarted NATS server may have lost its store: make sure the stream exists.
        if self._nc is not None:
            self._background(self._keep_recording(self._nc, self._stop))


def _show(spec: PortSpec | None) -> str:
    if spec is None:
        return "none"
    return f"{spec.value:+d}" if spec.relative else str(spec.value)
