"""``lig registry PATH...``: publish pools, models and endpoints from YAML files into JetStream KV.

Wiring only: the input format is in :mod:`.crd`, validation in :mod:`.loader`, file reading in
:mod:`.files`, the KV diff in :mod:`.publisher` and the watch/reload/publish loop in
:mod:`.reconciler`. SIGHUP forces a reload; SIGTERM/SIGINT stop within about a second.
``--check`` validates and prints a summary without NATS (exit 2 on invalid input).
``--kubernetes`` reads the objects from the API server instead (:mod:`.kube_source`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from functools import partial

from prometheus_client import start_http_server

from services.registry.check import EXIT_INVALID, check
from services.registry.kube_objects import KubeState
from services.registry.kube_reconciler import KubeReconciler
from services.registry.kube_source import KubeSource, make_client
from services.registry.metrics import RegistryMetrics
from services.registry.overrides import EndpointsOverride, OverrideError, read_override
from services.registry.publisher import Publisher
from services.registry.reconciler import Reconciler
from shared.logs import add_logging_arguments, setup_logging
from shared.nats_connection import add_nats_arguments, connect, settings_from_args
from shared.replication import warn_about_replication
from shared.service import cancel_and_wait, finish_within, run_service
from shared.subjects import Subjects

log = logging.getLogger("lig.registry")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the registry's flags."""
    env_paths = [p for p in os.environ.get("LIG_REGISTRY_PATHS", "").split(":") if p]
    parser.add_argument("paths", nargs="*", metavar="PATH", default=env_paths,
                        help="YAML files or folders of InferencePool/InferenceModel objects "
                             "(env LIG_REGISTRY_PATHS, colon-separated)")
    parser.add_argument("--check", action="store_true",
                        help="validate the inputs, print a summary and exit (2 when invalid); "
                             "needs no NATS")
    parser.add_argument("--allow-empty", action="store_true",
                        default=os.environ.get("LIG_REGISTRY_ALLOW_EMPTY", "").lower()
                        in ("1", "true", "yes"),
                        help="publish inputs that remove every pool, or every endpoint of a pool "
                             "(an emptied file or folder); without it such an input is refused, "
                             "logged and counted, and the last good state stays published "
                             "(env LIG_REGISTRY_ALLOW_EMPTY=1)")
    parser.add_argument("--endpoints-override", metavar="FILE", default=None,
                        help="YAML file naming one pool and the endpoints that replace the ones "
                             "the inputs list for it (read once, at start); `lig up` uses it for "
                             "simulated pods, so that the registry reads your folder directly")
    parser.add_argument("--host", default=os.environ.get("LIG_HOST", "0.0.0.0"),
                        help="address the metrics server listens on (env LIG_HOST)")
    parser.add_argument("--metrics-port", type=int, default=9092,
                        help="Prometheus metrics port; 0 disables")
    parser.add_argument("--watch-interval", type=float, default=0.5,
                        help="seconds between checks of the inputs for changes; 0 reloads "
                             "only on SIGHUP")
    parser.add_argument("--resync-interval", type=float, default=30.0,
                        help="seconds between checks that the bucket still holds the desired "
                             "state; 0 checks only after changes and reconnects")
    kube = parser.add_argument_group("Kubernetes source (docs/kubernetes.md)")
    kube.add_argument("--kubernetes", action="store_true",
                      help="read InferencePools, their Pods, InferenceObjectives, "
                           "InferenceModelRewrites and InferenceModels from the Kubernetes API "
                           "server (list+watch) instead of PATHs")
    kube.add_argument("--namespace", default=os.environ.get("LIG_NAMESPACE") or None,
                      help="namespace to watch (env LIG_NAMESPACE; default: the kubeconfig "
                           "context's, or the pod's own in a cluster)")
    kube.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG") or None,
                      help="kubeconfig file (env KUBECONFIG; default: the pod's service account)")
    add_nats_arguments(parser)
    add_logging_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Validate (``--check``) or serve until SIGTERM."""
    if args.kubernetes and (args.paths or args.check or args.endpoints_override):
        print("lig registry: --kubernetes takes no PATH, --check or --endpoints-override",
              file=sys.stderr)
        return EXIT_INVALID
    if not args.paths and not args.kubernetes:
        print("lig registry: no PATH given (or set LIG_REGISTRY_PATHS)", file=sys.stderr)
        return EXIT_INVALID
    if args.check:
        return check(args.paths, sys.stdout, sys.stderr)
    try:
        override = read_override(args.endpoints_override) if args.endpoints_override else None
    except OverrideError as exc:
        print(f"lig registry: --endpoints-override {exc}", file=sys.stderr)
        return EXIT_INVALID
    setup_logging("registry", args.log_level)
    return run_service(partial(_serve, args, override))


async def _serve(args: argparse.Namespace, override: EndpointsOverride | None,
                 stop: asyncio.Event) -> int:
    metrics = RegistryMetrics()
    source: KubeSource | None = None
    if args.kubernetes:
        reconciler: Reconciler = KubeReconciler(KubeState(), metrics,
                                                resync_interval=args.resync_interval)
        source = KubeSource(make_client(args.kubeconfig, args.namespace), reconciler.state,
                            reconciler.request_reload)
    else:
        reconciler = Reconciler(args.paths, metrics, watch_interval=args.watch_interval,
                                resync_interval=args.resync_interval,
                                allow_empty=args.allow_empty, override=override)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reconciler.request_reload)
    if override is not None:
        log.info("pool %s: its %d endpoint(s) come from %s, not from the inputs", override.pool,
                 len(override.endpoints), args.endpoints_override)
    if source is None:
        # Validate before connecting, so that input errors show even while NATS is unreachable.
        await reconciler.check_inputs()
    server = None
    if args.metrics_port:
        server, _ = start_http_server(args.metrics_port, args.host, registry=metrics.prometheus)
    work = asyncio.create_task(_publish_forever(args, reconciler, source,
                                                metrics_port=args.metrics_port))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    await cancel_and_wait(work)
    code = 0
    if work.done() and not work.cancelled() and work.exception() is not None:
        # e.g. NATS refused our credentials: say so instead of dying silently
        log.error("registry failed", exc_info=work.exception())
        code = 1
    if server is not None:
        server.shutdown()
        server.server_close()
    log.info("registry stopped")
    return code


async def _publish_forever(
    args: argparse.Namespace, reconciler: Reconciler, source: KubeSource | None, metrics_port: int
) -> None:
    settings = settings_from_args(args)

    async def on_reconnect() -> None:
        reconciler.request_resync()

    nc = await connect(settings, "lig-registry", on_reconnect=on_reconnect)
    warn_about_replication(nc, settings.replicas, "registry")
    try:
        bucket = Subjects(settings.prefix).registry_bucket
        metrics_at = f"http://{args.host}:{metrics_port}/metrics" if metrics_port else "disabled"
        watching = (f"Kubernetes namespace {source.namespace}" if source is not None
                    else ", ".join(reconciler.paths))
        log.info("ready: watching %s, publishing to KV bucket %s at %s; metrics %s",
                 watching, bucket, settings.url, metrics_at)
        publishing = reconciler.run(Publisher(nc.jetstream(), bucket, settings.replicas))
        if source is None:
            await publishing
            return
        async with asyncio.TaskGroup() as group:
            group.create_task(publishing)
            group.create_task(_sync_then_publish(source, reconciler))
            await source.run()
    finally:
        await finish_within(nc.close(), 1.0)


async def _sync_then_publish(source: KubeSource, reconciler: Reconciler) -> None:
    """Let the Kubernetes reconciler publish once every kind has been listed."""
    await source.synced.wait()
    assert isinstance(reconciler, KubeReconciler)
    reconciler.synced = True
    reconciler.request_reload()
