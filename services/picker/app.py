"""The picker's app: everything ``lig picker`` runs, as one coroutine (:func:`serve`).

Wires the parts: registry watch and metric snapshots from NATS into the pod table and router;
the ext_proc gRPC server; gRPC health; Prometheus metrics; and a housekeeping loop that flips
readiness and refreshes the gauges. It changes nothing process-wide (the entry points,
:mod:`services.picker.main` and :mod:`services.picker.workers`, call :func:`tune_process`), so
tests run it in their own event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import sys
from collections.abc import Callable

import grpc
import msgspec
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from nats.aio.client import Client
from prometheus_client import CollectorRegistry

from protocols.http2 import Http2Server
from scheduling.precise_index import PreciseIndex
from services.picker import core
from services.picker.batch_sender import BatchSender
from services.picker.decision_stream import (
    DecisionSink,
    Publishing,
    decision_queue,
    record_queue,
    subscribe_decisions,
)
from services.picker.ext_proc import ExternalProcessor, Processor, http2_handlers
from services.picker.health import PickerHealth
from services.picker.kv_blocks_feed import KVBlocksSink
from services.picker.kv_blocks_feed import subscribe as subscribe_kv_blocks
from services.picker.metrics_feed import SnapshotSink, subscribe
from services.picker.observability import PickerMetrics
from services.picker.pools import Gateway
from services.picker.settings import PickerSettings
from services.picker.state import PodTable
from services.picker.tls import TlsFiles, grpc_credentials, ssl_context
from shared.errors import ExitCode
from shared.host.errors import PortInUse
from shared.host.lifespan import Lifespan
from shared.nats_connection import NatsSettings, connection
from shared.registry_view import RegistryView, RegistryWatcher
from shared.service import cancel_and_wait
from shared.subjects import Subjects
from shared.waits import wait_set

log = logging.getLogger("lig.picker")

HOUSEKEEPING_INTERVAL = 0.25  # seconds between readiness checks and gauge refreshes
LISTENER_CHECK_INTERVAL = 0.25  # seconds between checks that the ext_proc server still listens
SHUTDOWN_GRACE = 0.5  # seconds open streams get once the drain delay is over
# What a picker needs to stop beyond its drain delay and grace: the NATS side, housekeeping and
# the servers' close, each bounded (see serve); the --workers supervisor waits this long.
STOP_MARGIN = 2.5
# Envoy's 32 MiB body buffer (deploy/envoy) plus room for headers and framing: also what one
# connection of the built-in server may hold in partial messages, so no larger than needed.
MAX_MESSAGE_BYTES = 33 * 1024 * 1024
GIL_SWITCH_INTERVAL = 0.0002  # seconds (Python's default is 5 ms)


def tune_process() -> None:
    """Process-wide settings for a picker process (its entry points call this, not serve)."""
    # grpc.aio hands every completion from its poller thread to the event loop's thread; with
    # the default 5 ms GIL switch interval that hand-off waits behind any busy Python code.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)


def stop_timeout(settings: PickerSettings) -> float:
    """Seconds a picker may take from SIGTERM to exit: drain delay, grace for open streams,
    and the bounded closing of everything else."""
    return settings.drain_delay + SHUTDOWN_GRACE + STOP_MARGIN


def build_gateway(settings: PickerSettings, metrics: PickerMetrics,
                  publishing: Publishing | None = None) -> Gateway:
    """The decision core over the served pools (:mod:`services.picker.core`, also what
    ``lig bench`` runs), reporting to the picker's metrics; ``publishing`` publishes its
    decisions and records (None: neither)."""
    decisions = records = None
    picker_id = ""
    if publishing is not None:
        decisions, records = publishing.decisions, publishing.records
        picker_id = publishing.picker_id if decisions is not None else ""
    return core.build_gateway(settings, hooks=core.CoreHooks(
        on_gray_exclusion=lambda pod, reason: metrics.gray_exclusions.labels(pod, reason).inc(),
        on_all_stale=metrics.all_stale.inc,
        on_conflicts=metrics.model_conflicts.set),
        on_decision=decisions, picker_id=picker_id, on_record=records)


def decision_publisher(settings: PickerSettings, subjects: Subjects,
                       metrics: PickerMetrics) -> Publishing | None:
    """The decision stream's and the decision records' publisher under a fresh picker id
    (None with both ``--no-shared-decisions`` and ``--no-record-decisions``): a restarted
    picker is a new peer, its old counts expire."""
    if not (settings.shared_decisions or settings.record_decisions):
        return None
    picker_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    sender = BatchSender(picker_id, delay=settings.decision_batch_delay)
    decisions = records = None
    if settings.shared_decisions:
        dropped = metrics.decisions_dropped
        decisions = decision_queue(
            sender, subjects, on_published=metrics.decisions_published.inc,
            on_dropped=lambda reason, count: dropped.labels(reason).inc(count))
    if settings.record_decisions:
        records_dropped = metrics.records_dropped
        records = record_queue(
            sender, subjects, on_published=metrics.records_published.inc,
            on_dropped=lambda reason, count: records_dropped.labels(reason).inc(count))
    return Publishing(sender, decisions, records)


def grpc_server(reuse_port: bool) -> grpc.aio.Server:
    """A grpc.aio server tuned for Envoy: large bodies, Envoy's keepalive pings allowed."""
    return grpc.aio.server(options=[
        ("grpc.so_reuseport", 1 if reuse_port else 0),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
        ("grpc.http2.max_ping_strikes", 0),
    ])


def _check_bindable(what: str, host: str, port: int, reuse_port: bool) -> None:
    """Raise :class:`PortInUse` when ``host:port`` cannot be bound (grpcio would log its own
    error first). A port shared through SO_REUSEPORT by this picker's workers passes."""
    if not port:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            probe.bind(address)
    except OSError as exc:
        raise PortInUse(what, host, port, exc) from None


def _listen(what: str, server: grpc.aio.Server, host: str, port: int, reuse_port: bool,
            credentials: grpc.ServerCredentials | None = None) -> int:
    _check_bindable(what, host, port, reuse_port)
    address = f"{host}:{port}"
    try:
        bound = (server.add_secure_port(address, credentials) if credentials is not None
                 else server.add_insecure_port(address))
    except RuntimeError:
        bound = 0
    if not bound:
        raise PortInUse(what, host, port, "in use?")
    return bound


class _GrpcAioExtProc:
    """The ext_proc service on a grpc.aio server."""

    def __init__(self, processor: Processor, host: str, port: int, reuse_port: bool,
                 tls: TlsFiles | None) -> None:
        self._server = grpc_server(reuse_port)
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
            ExternalProcessor(processor), self._server)
        self.port = _listen("ext_proc", self._server, host, port, reuse_port,
                            grpc_credentials(tls) if tls is not None else None)

    async def start(self) -> None:
        await self._server.start()

    async def stop(self, grace: float) -> None:
        await self._server.stop(grace)

    async def wait_lost(self) -> str:
        """Return, saying why, once the server has stopped: grpcio ends its serving loop and
        closes the listener on some inputs (a ``:path`` that is not UTF-8)."""
        try:
            # With a timeout grpcio waits on a shielded future: cancelling this wait (when the
            # picker is told to stop) must not cancel the server's own shutdown future.
            while await self._server.wait_for_termination(LISTENER_CHECK_INTERVAL):
                pass
        except Exception as exc:  # the error that ended grpcio's serving loop
            return f"grpc.aio's serving loop failed: {type(exc).__name__}: {exc}"
        return "the grpc.aio server terminated"


class _BuiltinExtProc:
    """The ext_proc service on the built-in HTTP/2 server."""

    def __init__(self, processor: Processor, host: str, port: int, reuse_port: bool,
                 tls: TlsFiles | None) -> None:
        self._server = Http2Server(http2_handlers(processor), MAX_MESSAGE_BYTES,
                                   on_error=processor.metrics.count_http2_error)
        self._address = (host, port, reuse_port)
        self._ssl = ssl_context(tls) if tls is not None else None
        self.port = port

    async def start(self) -> None:
        host, port, reuse_port = self._address
        _check_bindable("ext_proc", host, port, reuse_port)  # the same error as grpc.aio's
        try:
            self.port = await self._server.start(host, port, reuse_port, self._ssl)
        except OSError as exc:
            raise PortInUse("ext_proc", host, port, exc) from None

    async def stop(self, grace: float) -> None:
        await self._server.stop(grace)

    async def wait_lost(self) -> str:
        """Return, saying why, once the listening socket no longer accepts connections
        (polled: asyncio's server offers no notification for it)."""
        while True:
            await asyncio.sleep(LISTENER_CHECK_INTERVAL)
            if not self._server.serving():
                return "the built-in server's listening socket closed"


class _Shutdown(msgspec.Struct):
    """What the way out depends on, known only once serving ends."""

    drain: float = 0.0  # seconds to go on serving with health failing


async def serve(settings: PickerSettings, stop: asyncio.Event, registry: CollectorRegistry,
                metrics_port: int | None, reuse_port: bool = False,
                on_started: Callable[[], None] | None = None) -> int:
    """The picker: serve until ``stop`` is set, then shut down within ~2 s plus the drain delay.

    Changes nothing process-wide: ``on_started`` (the entry point's ``gc.freeze``, say) runs
    once every server listens. Returns 0, or ``ExitCode.EXT_PROC_LOST``; raises
    :class:`PortInUse` when a port cannot be bound (nothing stays open then).
    """
    metrics = PickerMetrics(registry)
    subjects = Subjects(settings.nats.prefix)
    publishing = decision_publisher(settings, subjects, metrics)
    gateway = build_gateway(settings, metrics, publishing)
    metrics.load_estimate.tables = lambda: {
        pool: router.pods for pool, router in gateway.routers.items()}
    metrics.precise.indexes = lambda: {
        pool: router.precise for pool, router in gateway.routers.items()
        if router.precise.max_blocks}
    metrics.prefix.indexes = lambda: {
        pool: router.prefixes for pool, router in gateway.routers.items()
        if router.prefixes.max_entries}
    processor = Processor(gateway, metrics, settings.destination_header,
                          record_responses=settings.record_responses,
                          conformance=settings.conformance_test_headers)
    tls = settings.tls
    host = settings.host
    shutdown = _Shutdown()
    async with Lifespan() as life:
        # Released in reverse: health fails at once, serving goes on for the drain delay, then
        # the NATS side and housekeeping end, ext_proc closes, and the metrics server last.
        life.metrics_server(host, metrics_port or 0, registry)
        health_server = grpc_server(reuse_port)
        health = PickerHealth(health_server)
        health_port = _listen("health", health_server, host, settings.health_port, reuse_port)
        ext_proc_type = _BuiltinExtProc if settings.server == "builtin" else _GrpcAioExtProc
        ext_proc = ext_proc_type(processor, host, settings.grpc_port, reuse_port, tls)
        # Nothing may outlive the loop: a grpc.aio server still running when it closes prints
        # an "Event loop is closed" traceback on exit.
        life.on_close(lambda: ext_proc.stop(SHUTDOWN_GRACE), within=SHUTDOWN_GRACE + 1.0)
        await ext_proc.start()
        nats = _NatsLink(settings.nats, subjects, RegistryView(), gateway, metrics, publishing,
                         kv_blocks=settings.precise_blocks > 0,
                         kv_history=settings.precise_history)
        tasks = (asyncio.create_task(nats.run(stop)),
                 asyncio.create_task(_housekeeping(stop, nats, gateway, health, metrics)))
        # After the drain, ext_proc, the NATS side and housekeeping end together: each may take
        # up to ~0.5 s, and one after another they would stretch the stop (ext_proc's own close
        # above, for a failed start, then finds it stopped already).
        life.on_close(lambda: asyncio.gather(ext_proc.stop(SHUTDOWN_GRACE),
                                             *(cancel_and_wait(task) for task in tasks)),
                      within=SHUTDOWN_GRACE + 2.0)
        life.on_close(lambda: asyncio.sleep(shutdown.drain), within=settings.drain_delay + 0.5)
        await health.start()
        life.on_close(lambda: health.stop(0), within=1.0)
        if on_started is not None:
            on_started()
        _log_started(settings, ext_proc.port, health_port, metrics_port, publishing)
        lost = await _until_stopped_or_lost(stop, ext_proc)
        if lost is not None:
            # The ext_proc port no longer answers: report it at once and exit, so that Envoy,
            # the orchestrator (Kubernetes, the --workers supervisor) or the operator replace us.
            log.error("the ext_proc server stopped (%s); health reports NOT_SERVING and the "
                      "picker exits with code %d to be restarted", lost, ExitCode.EXT_PROC_LOST)
        else:
            shutdown.drain = settings.drain_delay if health.ready else 0.0  # never ready: idle
            log.info("picker stopping: health checks fail from now on; serving %.1fs more "
                     "while Envoy moves new requests to other replicas", shutdown.drain)
    return 0 if lost is None else ExitCode.EXT_PROC_LOST


def _log_started(settings: PickerSettings, grpc_port: int, health_port: int,
                 metrics_port: int | None, publishing: Publishing | None) -> None:
    tls = settings.tls
    host = settings.host
    log.info("picker for %s: ext_proc (%s server, %s) on %s:%d, health on %s:%d, metrics "
             "on %s, NATS %s, load estimate %s, shared decisions %s, decision records %s",
             "pools " + ", ".join(settings.pools) if settings.pools else "every pool",
             settings.server,
             "plaintext" if tls is None else "mutual TLS" if tls.client_ca else "TLS",
             host, grpc_port, host, health_port,
             f"{host}:{metrics_port}" if metrics_port else "(off)", settings.nats.url,
             "on" if settings.load_estimate else "off",
             f"on (picker id {publishing.picker_id})"
             if publishing is not None and publishing.decisions is not None else "off",
             ("on, with responses" if settings.record_responses else "on")
             if settings.record_decisions else "off")
    log.info("pools served: %s; unknown models: %s",
             ", ".join(settings.pools) or "every pool of the registry",
             "rejected (404)" if settings.reject_unknown_models else
             f"pool {settings.default_pool}" if settings.default_pool else
             "the only pool served, else rejected (404)")
    if settings.conformance_test_headers:
        log.warning("--conformance-test-headers is on: clients choose their pod with the "
                    "test-epp-endpoint-selection header (any pod of the pool). For the Gateway "
                    "API Inference Extension's conformance suite only; never in production")


async def _until_stopped_or_lost(stop: asyncio.Event,
                                 ext_proc: _BuiltinExtProc | _GrpcAioExtProc) -> str | None:
    """Wait for ``stop`` (None) or for the ext_proc server to stop by itself (why it did)."""
    lost = asyncio.create_task(ext_proc.wait_lost())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({lost, stopping}, return_when=asyncio.FIRST_COMPLETED)
    for task in (lost, stopping):
        await cancel_and_wait(task)
    if stop.is_set() or not lost.done() or lost.cancelled():
        return None
    return lost.result()


class _NatsLink:
    """The NATS side: connect (forever), watch the registry, subscribe to snapshots (and,
    with ``kv_blocks``, to the pods' KV block-set changes)."""

    def __init__(self, settings: NatsSettings, subjects: Subjects, view: RegistryView,
                 gateway: Gateway, metrics: PickerMetrics,
                 publishing: Publishing | None = None, kv_blocks: bool = False,
                 kv_history: bool = False) -> None:
        self._settings = settings
        self._subjects = subjects
        self._metrics = metrics
        self.client: Client | None = None
        self.watcher: RegistryWatcher | None = None
        self._view = view
        self._gateway = gateway
        self.sink = SnapshotSink(
            gateway.table,
            on_undecodable=metrics.undecodable.labels("metrics").inc,
            on_out_of_order=metrics.out_of_order.inc,
            on_wrong_address=metrics.wrong_address.inc,
            on_received=metrics.snapshots.inc)
        self._kv_history = kv_history
        self.kv_blocks_sink = KVBlocksSink(
            self._precise_index, on_skip=lambda reason: metrics.kv_blocks_skipped.labels(
                reason).inc()) if kv_blocks else None
        self.publishing = publishing
        self.decision_sink = DecisionSink(
            gateway.apply_peer, on_undecodable=metrics.undecodable.labels("decisions").inc)

    def _precise_index(self, pool: str) -> tuple[PreciseIndex, PodTable] | None:
        router = self._gateway.routers.get(pool)
        if router is None or not router.precise.max_blocks:
            return None
        return router.precise, router.pods

    async def _follow_kv_blocks(self, client: Client, pools: list[str]) -> None:
        """Subscribe to the pods' KV block changes (a failure is logged: the precise index then
        learns nothing, the approximate one still serves)."""
        assert self.kv_blocks_sink is not None
        if self._kv_history and not pools and self.watcher is not None:
            # Serving every pool, the pools' routers come from the registry: the recording's
            # changes read before it would be skipped as of a pool not served (and what builds
            # on them, for unknown parents). So the recording is read once the registry is.
            await self.watcher.synced.wait()
        try:
            await subscribe_kv_blocks(client, self._subjects, self.kv_blocks_sink, pools,
                                      history=self._kv_history)
        except Exception:
            log.exception("cannot subscribe to the KV block changes; prefix scoring uses the "
                          "approximate index")

    @property
    def connected(self) -> bool:
        """True while the NATS connection is up."""
        return self.client is not None and self.client.is_connected

    @property
    def synced(self) -> bool:
        """True once the registry view has been loaded."""
        return self.watcher is not None and self.watcher.synced.is_set()

    async def run(self, stop: asyncio.Event) -> None:
        """Connect, follow the registry until ``stop``, then close the connection."""

        async def on_reconnect() -> None:
            # nats-py's KV watch can stall for seconds after a server restart: rebuild it.
            if self.watcher is not None:
                self.watcher.resync()

        # no_echo: the picker consumes nothing it publishes; its own decision batches would
        # come back (one message per batch) only to be decoded and dropped.
        async with connection(self._settings, "lig-picker", stop, on_reconnect=on_reconnect,
                              close_within=0.5, no_echo=True) as client:
            if client is None:
                return
            self.client = client
            undecodable = self._metrics.undecodable.labels("registry")
            self.watcher = RegistryWatcher(
                client.jetstream(), self._subjects.registry_bucket, self._view,
                on_changes=lambda changes: self._gateway.update(self._view, changes),
                on_undecodable=lambda key, exc: undecodable.inc())
            pools = [] if self._gateway.all_pools else list(self._gateway.routers)
            await subscribe(client, self._subjects, self.sink, pools)
            background = []
            if self.kv_blocks_sink is not None:
                # Its own task: looking up the recording must not delay the registry watch.
                background.append(asyncio.create_task(self._follow_kv_blocks(client, pools)))
            if self.publishing is not None:
                if self.publishing.decisions is not None:
                    await subscribe_decisions(client, self._subjects, self.decision_sink, pools)
                background.append(asyncio.create_task(self.publishing.sender.run(client)))
            try:
                await self.watcher.run(stop)
            finally:
                for task in background:
                    await cancel_and_wait(task)


async def _housekeeping(stop: asyncio.Event, nats: _NatsLink, gateway: Gateway,
                        health: PickerHealth, metrics: PickerMetrics) -> None:
    reported = {"applied": 0, "expired": 0}
    while not stop.is_set():
        if not health.ready and nats.synced and gateway.has_member_snapshot():
            await health.set_ready()
            metrics.ready.set(1)
            log.info("picker ready: registry synced and metric snapshots arriving")
        metrics.nats_connected.set(1 if nats.connected else 0)
        metrics.show_pods(gateway.freshness(), gateway.in_flight())
        _sync_peer_metrics(gateway, metrics, reported)
        await wait_set(stop, HOUSEKEEPING_INTERVAL)


def _sync_peer_metrics(gateway: Gateway, metrics: PickerMetrics,
                       reported: dict[str, int]) -> None:
    """Expire what silent peers contributed, and add to the decision-stream counters what
    :class:`~services.picker.peer_decisions.PeerDecisions` counted since ``reported`` (its
    hot path touches no Prometheus object)."""
    peers = gateway.peers
    peers.expire()
    for name, counter, total in (("applied", metrics.decisions_applied, peers.applied),
                                 ("expired", metrics.decisions_expired, peers.expired)):
        if total > reported[name]:
            counter.inc(total - reported[name])
            reported[name] = total
    metrics.decision_peers.set(peers.peers())
