"""``lig kv-events``: subscribe to every pod's vLLM KV-cache events, republish block changes.

A service beside the collector rather than inside it: it holds one long-lived ZMQ connection per
pod (the collector holds none), its failure modes (a flood, a stuck replay, a decoder bug) must
not delay metric snapshots, and a fleet without events does not run it at all. Pods come from
the registry. Replicas share them as collectors do: heartbeats on ``<prefix>.kvevents.<id>``
(the collector's :class:`~services.collector.membership.Membership`) and rendezvous hashing, so
a dead replica's pods move to the others within two heartbeats; ``--shards``/``--shard`` split
them statically instead. Wiring only: :class:`~services.kvevents.pod_stream.PodStream` does the
work.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Coroutine
from typing import Annotated, Any

import msgspec
import zmq.asyncio
from nats.aio.client import Client

from services.collector.membership import HeartbeatSubjects, Membership, default_member_id
from services.kvevents.observability import KVEventsMetrics
from services.kvevents.pod_stream import PodEndpoints, PodStream, StreamSettings
from services.kvevents.publisher import BlockPublisher
from services.kvevents.recording import last_recorded, stream_config
from services.kvevents.sequencing import resume_point
from services.kvevents.targets import (
    PortSpec,
    Share,
    parse_lora_ids,
    parse_port,
    parse_ranks,
    pods_from_view,
)
from shared import ports
from shared.host.lifespan import Lifespan
from shared.host.settings import add_flags, from_args, option
from shared.kv_events import KVEventDecoder, Limits
from shared.logs import LogLevel, setup_logging
from shared.nats_connection import NatsSettings, connection
from shared.recording import keep_stream
from shared.registry_view import RegistryView, RegistryWatcher
from shared.replication import warn_about_replication
from shared.service import run_service
from shared.subjects import Subjects

log = logging.getLogger("lig.kv_events")

SHUTDOWN_TIMEOUT_S = 1.0
MAX_DP_RANKS = 1024


class KVEventsSettings(msgspec.Struct, frozen=True):
    """Everything ``lig kv-events`` is configured with: one field per flag."""

    nats: NatsSettings = NatsSettings()
    # Text as given (the registry has no events port): N, +N or -N, read by events/replay.
    events_port: Annotated[str, option(
        "each pod's KV-event PUB port: N, or +N/-N relative to the port the pod serves on "
        "(several pods on one host, as with lig sim)", metavar="PORT")] = str(ports.KV_EVENTS)
    replay_port: Annotated[str, option(
        "each pod's replay ROUTER port, same forms; 'none': no replay (every gap then becomes "
        "a resync marker)", metavar="PORT")] = str(ports.KV_EVENTS_REPLAY)
    dp_ranks: Annotated[str, option(
        "data-parallel ranks of each pod: N (ranks 0..N-1) or A-B (global ranks A..B, a node "
        "of a multi-node deployment); rank r publishes on both ports + r, as vLLM does, each "
        "with its own sequence", metavar="N|A-B")] = "1"
    lora_ids: Annotated[str, option(
        "adapter names for blocks that vLLM stores with a lora_id but no lora_name (older "
        "vLLM): ID=NAME,... (vLLM numbers --lora-modules from 1 in the order given); an id "
        "not listed files its blocks under lora-id:ID", metavar="ID=NAME,...")] = ""
    replica_id: Annotated[str, option(
        "this replica's name among the replicas sharing the pods", min_length=1,
        default_text="HOSTNAME-PID")] \
        = msgspec.field(default_factory=default_member_id)
    heartbeat_s: Annotated[float, option(
        "seconds between the heartbeats by which replicas share the pods (rendezvous hashing "
        "on pool/pod): a dead replica's pods move to the others within two heartbeats; 0: no "
        "heartbeats, this replica follows every pod (of its --shard)", flag="--heartbeat",
        ge=0)] = 1.0
    shards: Annotated[int, option(
        "above 1: split the pods statically between this many numbered replicas instead "
        "(no heartbeats)", ge=1)] = 1
    shard: Annotated[int, option("this replica's number, 0-based; below --shards", ge=0)] = 0
    replay_timeout_s: Annotated[float, option(
        "seconds to wait for each frame of a replay before giving up", flag="--replay-timeout",
        gt=0)] = StreamSettings().replay_timeout_s
    max_message_bytes: Annotated[int, option(
        "larger event messages are skipped (counted)", ge=64)] = Limits().max_message_bytes
    record_max_age_s: Annotated[float, option(
        "seconds of block changes the LIG_KVBLOCKS stream keeps; 0 disables recording",
        flag="--record-max-age", ge=0)] = 3600.0
    record_max_bytes: Annotated[int, option(
        "bytes the LIG_KVBLOCKS stream keeps at most (oldest dropped)", ge=1)] = 1 << 30
    buffer_messages: Annotated[int, option(
        "block-change messages held while NATS does not take them, published in order once "
        "it does; beyond, the pod with the most held bytes gets one resync marker instead",
        ge=1)] = 50_000
    buffer_bytes: Annotated[int, option(
        "encoded bytes of the block changes held so, at most", ge=1)] = 64 << 20
    host: Annotated[str, option("address the metrics endpoint listens on")] = "0.0.0.0"
    metrics_port: Annotated[int, option(
        "port of this service's Prometheus metrics; 0 disables", ge=0)] = ports.KV_EVENTS_METRICS
    log_level: LogLevel = "INFO"

    def __post_init__(self) -> None:
        # The bounds of single fields are their annotations; this checks the rest.
        if self.shard >= self.shards:
            raise ValueError("--shard (env LIG_SHARD) must be below --shards (env LIG_SHARDS)")
        # Each raises ValueError naming its flag.
        _ = (self.events, self.replay, self.ranks, self.lora_names)

    @property
    def events(self) -> PortSpec:
        """``--events-port`` parsed."""
        return parse_port(self.events_port, "--events-port (env LIG_EVENTS_PORT)")

    @property
    def replay(self) -> PortSpec | None:
        """``--replay-port`` parsed; None for ``none``."""
        if self.replay_port.strip().lower() == "none":
            return None
        return parse_port(self.replay_port, "--replay-port (env LIG_REPLAY_PORT)")

    @property
    def ranks(self) -> range:
        """``--dp-ranks`` parsed."""
        return parse_ranks(self.dp_ranks, "--dp-ranks (env LIG_DP_RANKS)", MAX_DP_RANKS)

    @property
    def lora_names(self) -> dict[int, str]:
        """``--lora-ids`` parsed."""
        return parse_lora_ids(self.lora_ids, "--lora-ids (env LIG_LORA_IDS)")

    @property
    def shares_by_heartbeat(self) -> bool:
        """Whether the replicas share the pods by heartbeats (else statically, or not)."""
        return self.shards == 1 and self.heartbeat_s > 0

    @property
    def stream(self) -> StreamSettings:
        """The bounds of each pod's stream."""
        return StreamSettings(replay_timeout_s=self.replay_timeout_s)

    @property
    def limits(self) -> Limits:
        """The bounds of one event message."""
        return Limits(max_message_bytes=self.max_message_bytes)


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``lig kv-events`` (one per :class:`KVEventsSettings` field)."""
    add_flags(parser, KVEventsSettings)


def settings_from(args: argparse.Namespace) -> KVEventsSettings:
    """Validated settings: flags, else ``LIG_*`` variables, else defaults; ConfigError (a
    ValueError) names the bad flag."""
    settings: KVEventsSettings = from_args(KVEventsSettings, args)
    return settings


def run(args: argparse.Namespace) -> int:
    """Run until SIGTERM/SIGINT."""
    settings = settings_from(args)
    setup_logging("kv-events", settings.log_level)
    return run_service(lambda stop: KVEventsService(settings).run(stop))


class KVEventsService:
    """The pods' streams, started and stopped as the registry changes."""

    def __init__(self, settings: KVEventsSettings) -> None:
        self.settings = settings
        self.subjects = Subjects(settings.nats.prefix)
        self.metrics = KVEventsMetrics()
        self.view = RegistryView()
        self.decoder = KVEventDecoder(settings.limits,
                                      lambda reason: self.metrics.skipped.labels(reason).inc(),
                                      settings.lora_names)
        self.publisher = BlockPublisher(self.subjects, self.metrics, settings.buffer_messages,
                                        settings.buffer_bytes)
        self.streams: dict[str, tuple[PodEndpoints, PodStream, asyncio.Task[None]]] = {}
        self.metrics.followed.set_function(
            lambda: sum(stream.following for _, stream, _ in self.streams.values()))
        self._ctx = zmq.asyncio.Context()
        self._nc: Client | None = None
        self._watcher: RegistryWatcher | None = None
        self.membership: Membership | None = None
        self._stop = asyncio.Event()
        self._recording: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> int:
        """Serve metrics, connect, work until ``stop`` is set, then leave cleanly."""
        settings = self.settings
        async with Lifespan() as life:
            # Last out: closing the context ends the sockets of a stream that outlived its bound.
            life.callback(lambda: self._ctx.destroy(linger=0))
            life.metrics_server(settings.host, settings.metrics_port, self.metrics.prometheus)
            # Drained on the way out: the last block changes go out.
            nc = await life.enter(connection(
                settings.nats, f"lig-kv-events {settings.replica_id}", stop,
                on_reconnect=self._reconnected, on_disconnect=self._disconnected,
                drain=True, close_within=SHUTDOWN_TIMEOUT_S))
            if nc is not None:
                self._start(nc, stop, life)
                await stop.wait()
        log.info("kv-events stopped")
        return 0

    def _start(self, nc: Client, stop: asyncio.Event, life: Lifespan) -> None:
        settings = self.settings
        self._nc, self._stop = nc, stop
        self.publisher.attach(nc)
        warn_about_replication(nc, settings.nats.replicas, "kv-events")
        self._watcher = RegistryWatcher(
            nc.jetstream(), self.subjects.registry_bucket, self.view, on_change=self.reconcile,
            on_undecodable=lambda key, exc: self.metrics.skipped.labels("registry").inc())
        life.on_close(self._stop_streams, within=SHUTDOWN_TIMEOUT_S)
        life.callback(self._stop_recording)
        self._start_recording(nc)
        if settings.shares_by_heartbeat:
            self.membership = Membership(
                nc, HeartbeatSubjects(self.subjects.kv_events_heartbeat,
                                      self.subjects.all_kv_events_heartbeats()),
                settings.replica_id, settings.heartbeat_s, self.reconcile,
                on_undecodable=lambda: self.metrics.skipped.labels("heartbeat").inc(),
                role="kv-events replica")
            # Its goodbye heartbeat hands this replica's pods to the others at once.
            life.task(self.membership.run(stop), finish=SHUTDOWN_TIMEOUT_S)
        life.task(self._watcher.run(stop), finish=SHUTDOWN_TIMEOUT_S)
        sharing = (f"replica {settings.replica_id}, sharing pods by heartbeats every "
                   f"{settings.heartbeat_s:g} s" if settings.shares_by_heartbeat
                   else f"shard {settings.shard} of {settings.shards}")
        ranks = settings.ranks
        log.info("kv-events ready: events port %s, replay port %s, rank(s) %s per pod, %s, "
                 "metrics on %s, nats %s", settings.events, settings.replay or "none",
                 f"{ranks.start}-{ranks.stop - 1}" if len(ranks) > 1 else ranks.start, sharing,
                 f"{settings.host}:{settings.metrics_port}" if settings.metrics_port else "off",
                 settings.nats.url)

    def share(self) -> Share | None:
        """The replicas this one shares the pods with now; None while it is still learning
        them (it follows no pod until then)."""
        settings = self.settings
        if not settings.shares_by_heartbeat:
            return Share.static(settings.shard, settings.shards)
        if self.membership is None or not self.membership.active:
            return None
        return Share(settings.replica_id, self.membership.members())

    def reconcile(self) -> None:
        """Subscribe to exactly the pods this shard owns now (a pod whose address or ports
        changed gets a fresh stream)."""
        settings = self.settings
        before = len(self.streams)
        share = self.share()
        wanted = {} if share is None else pods_from_view(
            self.view, settings.events, settings.replay, share, settings.ranks)
        if share is not None:
            self.metrics.replicas.set(len(share.members))
        gone = [key for key, (pod, _, _) in self.streams.items() if wanted.get(key) != pod]
        if gone:
            self._background(self._stop_tasks([self.streams.pop(key)[2] for key in gone]))
        for key, pod in wanted.items():
            if key not in self.streams:
                stream = PodStream(pod, self._ctx, self.decoder, self.publisher.publish,
                                   settings.stream, self._count)
                task = asyncio.create_task(self._run_stream(stream), name=f"kv-events {key}")
                self.streams[key] = (pod, stream, task)
        if len(self.streams) != before:
            log.info("following %d pod stream(s)", len(self.streams))
        self.metrics.pods.set(len(self.streams))

    def _count(self, outcome: str, n: int) -> None:
        self.metrics.batches.labels(outcome).inc(n)

    async def _run_stream(self, stream: PodStream) -> None:
        """One pod's stream, resumed from the recording; a bug in it is logged and the stream
        restarted (where it stood), others go on."""
        await self._resume(stream)
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

    async def _resume(self, stream: PodStream) -> None:
        """Continue the pod-rank's numbering and vLLM stream where the last message recorded
        on its subject left them (this bridge before a restart, or the replica that followed
        the pod before); without a recording, or with nothing of this rank in it, the stream
        starts from 0 as it always did."""
        if self._nc is None or self.settings.record_max_age_s <= 0:
            return
        pod = stream.pod
        recorded = await last_recorded(self._nc.jetstream(), self.subjects.kv_blocks_stream,
                                       self.subjects.kv_blocks(pod.pool, pod.pod))
        point = resume_point(recorded, pod.address, pod.dp_rank)
        if point is None:
            return
        self.publisher.resume((pod.pool, pod.pod, pod.dp_rank), point.next_stream_seq)
        if point.last is not None:
            stream.resume(point.last)
        log.info("%s/%s rank %d: resuming from the recording: message %d, after vLLM batch %s",
                 pod.pool, pod.pod, pod.dp_rank, point.next_stream_seq,
                 "none (from 0)" if point.last is None else point.last[0])

    def _start_recording(self, nc: Client) -> None:
        settings = self.settings
        if settings.record_max_age_s <= 0:
            return
        if self._recording is not None:
            self._recording.cancel()
        wanted = stream_config(self.subjects, settings.record_max_age_s,
                               settings.record_max_bytes, settings.nats.replicas)
        self._recording = asyncio.create_task(keep_stream(nc.jetstream(), wanted, self._stop))

    def _stop_recording(self) -> None:
        if self._recording is not None:
            self._recording.cancel()

    async def _stop_streams(self) -> None:
        await self._stop_tasks([task for _, _, task in self.streams.values()])

    async def _disconnected(self) -> None:
        if self.membership is not None:
            self.membership.disconnected()

    async def _reconnected(self) -> None:
        # What NATS could not take while away goes out first, in order, before new changes.
        self._background(self.publisher.drain())
        if self._watcher is not None:
            self._watcher.resync()
        if self.membership is not None:
            await self.membership.reconnected()
        # A restarted NATS server may have lost its store: make sure the stream exists.
        if self._nc is not None:
            self._start_recording(self._nc)
