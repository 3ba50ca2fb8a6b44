"""``lig picker``: the Envoy ext_proc endpoint picker of one or more pools, fed from NATS.

Wires the parts: registry watch and metric snapshots from NATS into the pod table and router;
the ext_proc gRPC server; gRPC health; Prometheus metrics; and a housekeeping loop that flips
readiness and refreshes the gauges. ``--workers N`` runs N such processes on the same ports.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import random
import secrets
import socket
import sys
from wsgiref.simple_server import WSGIServer

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from nats.aio.client import Client
from prometheus_client import CollectorRegistry, start_http_server

from services.picker.decision_stream import (
    DEFAULT_DELAY,
    DecisionPublisher,
    DecisionSink,
    subscribe_decisions,
)
from services.picker.ext_proc import ExternalProcessor, Processor, http2_handlers
from services.picker.gray_pods import GrayPods
from services.picker.health import PickerHealth
from services.picker.http2 import Http2Server
from services.picker.metrics_feed import SnapshotSink, subscribe
from services.picker.observability import PickerMetrics
from services.picker.peer_decisions import DEFAULT_REQUEST_TTL
from services.picker.pools import Gateway, UnknownModels
from services.picker.routing import Router
from services.picker.state import PodTable
from services.picker.tls import (
    TlsFiles,
    add_tls_arguments,
    grpc_credentials,
    ssl_context,
    tls_from_args,
)
from shared.logs import add_logging_arguments, setup_logging
from shared.nats_connection import (
    NatsSettings,
    add_nats_arguments,
    connect,
    settings_from_args,
)
from shared.registry_view import RegistryView, RegistryWatcher
from shared.service import cancel_and_wait, finish_within, run_service
from shared.subjects import Subjects

log = logging.getLogger("lig.picker")

HOUSEKEEPING_INTERVAL = 0.25  # seconds between readiness checks and gauge refreshes
LISTENER_CHECK_INTERVAL = 0.25  # seconds between checks that the ext_proc server still listens
EXIT_EXT_PROC_LOST = 3  # exit code when the ext_proc server stopped without being asked to
SHUTDOWN_GRACE = 0.5  # seconds open streams get once the drain delay is over
# Envoy's 32 MiB body buffer (deploy/envoy) plus room for headers and framing: also what one
# connection of the built-in server may hold in partial messages, so no larger than needed.
MAX_MESSAGE_BYTES = 33 * 1024 * 1024
GIL_SWITCH_INTERVAL = 0.0002  # seconds (Python's default is 0.005)
SERVERS = ("builtin", "grpc-aio")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the picker's flags (see the service flag contract in the team brief)."""
    env = os.environ.get
    parser.add_argument("--pool", action="append", dest="pools", metavar="POOL",
                        default=None,
                        help="an InferencePool this picker serves; repeat for several (env "
                        "LIG_POOL, comma-separated). Without it the picker serves every pool of "
                        "the registry. Requests are routed to the pool that registers their "
                        "model; model names must be unique across the pools served")
    parser.add_argument("--default-pool", default=env("LIG_DEFAULT_POOL") or None,
                        help="the pool that takes requests for models no served pool registers "
                        "(its rejectUnknownModels field still applies). Default: the only pool "
                        "when one is served, else none (404) (env LIG_DEFAULT_POOL)")
    parser.add_argument("--reject-unknown-models", action=argparse.BooleanOptionalAction,
                        default=env("LIG_REJECT_UNKNOWN_MODELS", "") in ("1", "true", "yes"),
                        help="answer 404 to every request for a model no served pool "
                        "registers, whatever --default-pool and the pools' rejectUnknownModels "
                        "say (env LIG_REJECT_UNKNOWN_MODELS=1)")
    parser.add_argument("--host", default=env("LIG_HOST", "127.0.0.1"),
                        help="address the ext_proc, health and metrics ports listen on; loopback "
                        "by default because ext_proc is plaintext unless --tls-cert is given: "
                        "containers pass --host 0.0.0.0 explicitly (env LIG_HOST)")
    parser.add_argument("--grpc-port", type=int, default=9002, help="ext_proc gRPC port")
    parser.add_argument("--health-port", type=int, default=9003, help="gRPC health port")
    parser.add_argument("--metrics-port", type=int, default=9090,
                        help="Prometheus /metrics port (0 disables)")
    parser.add_argument("--server", choices=SERVERS, default=env("LIG_PICKER_SERVER", "builtin"),
                        help="the ext_proc server: 'builtin' (HTTP/2 in the event loop's thread; "
                        "about a quarter of the CPU per request) or 'grpc-aio' (the grpcio "
                        "library's asyncio server) (env LIG_PICKER_SERVER)")
    parser.add_argument("--workers", type=int, default=1,
                        help="processes sharing the ports (SO_REUSEPORT)")
    parser.add_argument("--drain-delay", type=float, default=1.1,
                        help="seconds the picker goes on serving after SIGTERM while its health "
                        "checks fail, so that Envoy (checking every second) has moved new "
                        "requests to other replicas before this one closes (skipped by a picker "
                        "that never became ready); responses already routed never depend on it")
    parser.add_argument("--stale-after", type=float, default=1.0,
                        help="seconds after which a pod's newest snapshot is stale")
    parser.add_argument("--load-estimate", action=argparse.BooleanOptionalAction, default=True,
                        help="count the requests this picker sent to a pod since its newest "
                        "snapshot in that pod's waiting queue (beyond the least-served pod's), so "
                        "that the requests of one scrape interval spread over the pods instead "
                        "of all going to the least loaded one; --no-load-estimate decides on the "
                        "scraped metrics alone, as upstream")
    parser.add_argument("--gray-after", type=float, default=2.0,
                        help="seconds before a pod's newest snapshot arrived after which a "
                        "request this picker sent to the pod, still unfinished, shows the pod "
                        "gray if the pod reports fewer running and "
                        "waiting requests than it has such requests (it is not running them); "
                        "a gray pod is left out for a cool-off (5 s, doubling on repeats), then "
                        "gets one request at a time until one succeeds. 0 disables this check")
    parser.add_argument("--outcome-sample", type=int, default=4, metavar="N",
                        help="ask Envoy for the response status of one request in N (and of "
                        "every request while a pod is left out or on probation); a pod whose "
                        "recent responses are mostly 5xx is gray. 0 never asks")
    parser.add_argument("--destination-header", default="x-gateway-destination-endpoint",
                        help="request header naming the chosen pod (ip:port) for Envoy")
    parser.add_argument("--fallbacks", type=_non_negative, default=0, metavar="N",
                        help="endpoint picker protocol: name up to N fallback pods after the "
                        "chosen one, in policy order, in the destination header and envoy.lb "
                        "metadata (ip:port,ip:port,...), for a gateway that retries down the "
                        "list. 0 (the default, as the reference picker's maxNumOfEndpoints=1) "
                        "names only the chosen pod, which is what an ORIGINAL_DST cluster "
                        "(the shipped Envoy bootstrap) can route")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed for the random choices (reproducible runs)")
    # The decision stream (issue 11, docs/decision-stream.md).
    parser.add_argument("--shared-decisions", action=argparse.BooleanOptionalAction,
                        default=env("LIG_SHARED_DECISIONS", "1").lower() not in
                        ("0", "false", "no", "off"),
                        help="share routing decisions with the other picker replicas over NATS "
                        "(<prefix>.decisions.<pool>): each counts its peers' requests in its "
                        "load estimate as its own, so that N replicas decide like one. "
                        "--no-shared-decisions (env LIG_SHARED_DECISIONS=0) counts only this "
                        "picker's requests, for comparison")
    parser.add_argument("--decision-batch-delay", type=float,
                        default=float(env("LIG_DECISION_BATCH_DELAY", str(DEFAULT_DELAY))),
                        metavar="SECONDS",
                        help="how long a decision waits for others to share one NATS message "
                        "(default %(default)s s; env LIG_DECISION_BATCH_DELAY)")
    parser.add_argument("--decision-request-ttl", type=float, default=DEFAULT_REQUEST_TTL,
                        metavar="SECONDS",
                        help="seconds after which a peer's request still counted in flight "
                        "without a finished event is dropped from the counts (a peer that goes "
                        "silent is dropped after 4 of its 0.5 s heartbeats regardless)")
    add_tls_arguments(parser)
    add_nats_arguments(parser)
    add_logging_arguments(parser)


def _non_negative(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def run(args: argparse.Namespace) -> int:
    """Run the picker until SIGTERM/SIGINT."""
    args.pools = served_pools(args.pools, os.environ.get("LIG_POOL", ""))
    if (args.default_pool is not None and not args.reject_unknown_models and args.pools
            and args.default_pool not in args.pools):
        raise SystemExit(f"--default-pool {args.default_pool} is not one of the pools served "
                         f"(--pool {' --pool '.join(args.pools)})")
    if args.workers < 1:
        raise SystemExit("--workers must be at least 1")
    args.tls = tls_from_args(args)  # wrong TLS flags fail here, before any worker starts
    if args.stale_after <= 0:
        raise SystemExit("--stale-after must be positive")
    if args.gray_after < 0 or args.outcome_sample < 0:
        raise SystemExit("--gray-after and --outcome-sample must not be negative")
    if args.decision_batch_delay < 0 or args.decision_request_ttl <= 0:
        raise SystemExit("--decision-batch-delay must not be negative and "
                         "--decision-request-ttl must be positive")
    setup_logging("picker", args.log_level)
    if args.workers > 1:
        from services.picker.workers import supervise

        return supervise(args)
    return run_service(lambda stop: serve(args, stop, CollectorRegistry(), args.metrics_port))


def served_pools(flags: list[str] | None, env_value: str) -> list[str]:
    """The pools to serve: the ``--pool`` flags, else ``LIG_POOL`` (comma-separated); empty
    means every pool of the registry. Duplicates are dropped, order kept."""
    names = flags if flags else env_value.split(",")
    return list(dict.fromkeys(name.strip() for name in names if name.strip()))


def build_gateway(args: argparse.Namespace, metrics: PickerMetrics,
                  decisions: DecisionPublisher | None = None) -> Gateway:
    """The gateway over the served pools, each pool with its own router and pod table;
    ``decisions`` publishes its decisions (None: not shared)."""
    rng = random.Random(args.seed)

    def make_router(pool: str) -> Router:
        pods = PodTable(args.stale_after, load_estimate=args.load_estimate,
                        gray=GrayPods(args.gray_after, args.outcome_sample,
                                      on_exclude=lambda pod, reason:
                                      metrics.gray_exclusions.labels(pod, reason).inc()))
        return Router(pool, pods, rng, on_all_stale=metrics.all_stale.inc,
                      fallbacks=args.fallbacks)

    unknown = UnknownModels(reject=args.reject_unknown_models, default_pool=args.default_pool)
    gateway = Gateway(args.pools, make_router, unknown, rng,
                      on_conflicts=metrics.model_conflicts.set, on_decision=decisions,
                      picker_id=decisions.picker_id if decisions is not None else "")
    gateway.peers.request_ttl = args.decision_request_ttl
    return gateway


def decision_publisher(args: argparse.Namespace, subjects: Subjects,
                       metrics: PickerMetrics) -> DecisionPublisher | None:
    """The decision stream's publisher under a fresh picker id (None with
    ``--no-shared-decisions``): a restarted picker is a new peer, its old counts expire."""
    if not args.shared_decisions:
        return None
    picker_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    dropped = metrics.decisions_dropped
    return DecisionPublisher(picker_id, subjects, delay=args.decision_batch_delay,
                             on_published=metrics.decisions_published.inc,
                             on_dropped=lambda reason, count: dropped.labels(reason).inc(count))


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


def _serve_metrics(host: str, port: int | None,
                   registry: CollectorRegistry) -> WSGIServer | None:
    if not port:
        return None
    try:
        server, _ = start_http_server(port, host, registry)
    except OSError as exc:
        raise SystemExit(f"picker: cannot serve metrics on {host}:{port}: {exc}") from None
    return server


def _check_bindable(host: str, port: int, reuse_port: bool) -> None:
    """Fail with one line when ``host:port`` cannot be bound (grpcio would log its own error
    first). A port shared through SO_REUSEPORT by this picker's workers passes."""
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
        raise SystemExit(f"picker: cannot listen on {host}:{port}: {exc}") from None


def _listen(server: grpc.aio.Server, host: str, port: int, reuse_port: bool,
            credentials: grpc.ServerCredentials | None = None) -> int:
    _check_bindable(host, port, reuse_port)
    address = f"{host}:{port}"
    try:
        bound = (server.add_secure_port(address, credentials) if credentials is not None
                 else server.add_insecure_port(address))
    except RuntimeError:
        bound = 0
    if not bound:
        raise SystemExit(f"picker: cannot listen on {host}:{port} (in use?)")
    return bound


class _GrpcAioExtProc:
    """The ext_proc service on a grpc.aio server."""

    def __init__(self, processor: Processor, host: str, port: int, reuse_port: bool,
                 tls: TlsFiles | None) -> None:
        self._server = grpc_server(reuse_port)
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
            ExternalProcessor(processor), self._server)
        self.port = _listen(self._server, host, port, reuse_port,
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
        _check_bindable(host, port, reuse_port)  # the same one-line error as grpc.aio's
        try:
            self.port = await self._server.start(host, port, reuse_port, self._ssl)
        except OSError as exc:
            raise SystemExit(f"picker: cannot listen on {host}:{port}: {exc}") from None

    async def stop(self, grace: float) -> None:
        await self._server.stop(grace)

    async def wait_lost(self) -> str:
        """Return, saying why, once the listening socket no longer accepts connections
        (polled: asyncio's server offers no notification for it)."""
        while True:
            await asyncio.sleep(LISTENER_CHECK_INTERVAL)
            if not self._server.serving():
                return "the built-in server's listening socket closed"


async def serve(args: argparse.Namespace, stop: asyncio.Event, registry: CollectorRegistry,
                metrics_port: int | None, reuse_port: bool = False) -> int:
    """The picker process: serve until ``stop`` is set, then shut down within ~2 s."""
    # grpc.aio hands every completion from its poller thread to the event loop's thread; with
    # the default 5 ms GIL switch interval that hand-off waits behind any busy Python code.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    metrics = PickerMetrics(registry)
    settings = settings_from_args(args)
    subjects = Subjects(settings.prefix)
    decisions = decision_publisher(args, subjects, metrics)
    gateway = build_gateway(args, metrics, decisions)
    metrics.load_estimate.tables = lambda: {
        pool: router.pods for pool, router in gateway.routers.items()}
    processor = Processor(gateway, metrics, args.destination_header)

    tls: TlsFiles | None = args.tls
    http_server = _serve_metrics(args.host, metrics_port, registry)
    ext_proc_type = _BuiltinExtProc if args.server == "builtin" else _GrpcAioExtProc
    health_server = grpc_server(reuse_port)
    health = PickerHealth(health_server)
    ext_proc: _BuiltinExtProc | _GrpcAioExtProc | None = None
    try:
        health_port = _listen(health_server, args.host, args.health_port, reuse_port)
        ext_proc = ext_proc_type(processor, args.host, args.grpc_port, reuse_port, tls)
        await ext_proc.start()
    except SystemExit:
        # Nothing may outlive the loop: a grpc.aio server still running when it closes prints
        # an "Event loop is closed" traceback on exit.
        if ext_proc is not None:
            await ext_proc.stop(0)
        if http_server is not None:
            http_server.shutdown()
        raise
    await health.start()
    # Everything allocated so far lives as long as the process: keep it out of the cyclic
    # collector's scans, which otherwise run every few hundred requests.
    gc.freeze()

    view = RegistryView()
    nats = _NatsLink(settings, subjects, view, gateway, metrics, decisions)
    tasks = [asyncio.create_task(nats.run(stop)),
             asyncio.create_task(_housekeeping(stop, nats, gateway, health, metrics))]
    log.info("picker for %s: ext_proc (%s server, %s) on %s:%d, health on %s:%d, metrics "
             "on %s, NATS %s, load estimate %s, shared decisions %s",
             "pools " + ", ".join(args.pools) if args.pools else "every pool", args.server,
             "plaintext" if tls is None else "mutual TLS" if tls.client_ca else "TLS",
             args.host, ext_proc.port,
             args.host, health_port,
             f"{args.host}:{metrics_port}" if metrics_port else "(off)", settings.url,
             "on" if args.load_estimate else "off",
             f"on (picker id {decisions.picker_id})" if decisions is not None else "off")
    log.info("pools served: %s; unknown models: %s",
             ", ".join(args.pools) or "every pool of the registry",
             "rejected (404)" if args.reject_unknown_models else
             f"pool {args.default_pool}" if args.default_pool else
             "the only pool served, else rejected (404)")
    lost = await _until_stopped_or_lost(stop, ext_proc)

    if lost is not None:
        # The ext_proc port no longer answers: report it at once and exit, so that Envoy, the
        # orchestrator (Kubernetes, the --workers supervisor) or the operator replace us.
        log.error("the ext_proc server stopped (%s); health reports NOT_SERVING and the "
                  "picker exits with code %d to be restarted", lost, EXIT_EXT_PROC_LOST)
        drain = 0.0
    else:
        drain = args.drain_delay if health.ready else 0.0  # never ready: Envoy sent nothing
        log.info("picker stopping: health checks fail from now on; serving %.1fs more while "
                 "Envoy moves new requests to other replicas", drain)
    await health.stop(0)
    await asyncio.sleep(drain)
    closing = [ext_proc.stop(SHUTDOWN_GRACE), *(cancel_and_wait(task) for task in tasks)]
    if http_server is not None:
        closing.append(asyncio.to_thread(http_server.shutdown))
    await asyncio.gather(*closing)
    return 0 if lost is None else EXIT_EXT_PROC_LOST


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
    """The NATS side: connect (forever), watch the registry, subscribe to snapshots."""

    def __init__(self, settings: NatsSettings, subjects: Subjects, view: RegistryView,
                 gateway: Gateway, metrics: PickerMetrics,
                 decisions: DecisionPublisher | None = None) -> None:
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
        self.decisions = decisions
        self.decision_sink = DecisionSink(
            gateway.apply_peer, on_undecodable=metrics.undecodable.labels("decisions").inc)

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

        self.client = await connect(self._settings, "lig-picker", on_reconnect=on_reconnect)
        try:
            undecodable = self._metrics.undecodable.labels("registry")
            self.watcher = RegistryWatcher(
                self.client.jetstream(), self._subjects.registry_bucket, self._view,
                on_changes=lambda changes: self._gateway.update(self._view, changes),
                on_undecodable=lambda key, exc: undecodable.inc())
            pools = [] if self._gateway.all_pools else list(self._gateway.routers)
            await subscribe(self.client, self._subjects, self.sink, pools)
            publishing = None
            if self.decisions is not None:
                await subscribe_decisions(self.client, self._subjects, self.decision_sink,
                                          pools)
                publishing = asyncio.create_task(self.decisions.run(self.client))
            try:
                await self.watcher.run(stop)
            finally:
                if publishing is not None:
                    await cancel_and_wait(publishing)
        finally:
            await finish_within(self.client.close(), 0.5)


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
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), HOUSEKEEPING_INTERVAL)


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
