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
import signal
import sys
from functools import partial
from typing import Annotated

import msgspec

from services.registry.check import check
from services.registry.kube_objects import KubeState
from services.registry.kube_reconciler import KubeReconciler
from services.registry.kube_source import KubeSource, make_client
from services.registry.metrics import RegistryMetrics
from services.registry.overrides import EndpointsOverride, OverrideError, read_override
from services.registry.publisher import Publisher
from services.registry.reconciler import Reconciler
from shared import ports
from shared.errors import ConfigError
from shared.host.lifespan import Lifespan
from shared.host.settings import add_flags, from_args, option
from shared.logs import LogLevel, setup_logging
from shared.nats_connection import NatsSettings, connection
from shared.replication import warn_about_replication
from shared.service import run_service
from shared.subjects import Subjects

log = logging.getLogger("lig.registry")


class RegistrySettings(msgspec.Struct, frozen=True):
    """Everything ``lig registry`` is configured with: one field per flag."""

    paths: Annotated[list[str], option(
        "YAML files or folders of InferencePool/InferenceModel objects (colon-separated in the "
        "environment)", positional=True, metavar="PATH", separator=":",
        aliases=("LIG_REGISTRY_PATHS",))] = []
    check: Annotated[bool, option(
        "validate the inputs, print a summary and exit (2 when invalid); needs no NATS")] = False
    allow_empty: Annotated[bool, option(
        "publish inputs that remove every pool, or every endpoint of a pool (an emptied file or "
        "folder); without it such an input is refused, logged and counted, and the last good "
        "state stays published", aliases=("LIG_REGISTRY_ALLOW_EMPTY",))] = False
    endpoints_override: Annotated[str | None, option(
        "YAML file naming one pool and the endpoints that replace the ones the inputs list for "
        "it (read once, at start); `lig up` uses it for simulated pods, so that the registry "
        "reads your folder directly", metavar="FILE")] = None
    host: Annotated[str, option("address the metrics server listens on")] = "0.0.0.0"
    metrics_port: Annotated[int, option("Prometheus metrics port; 0 disables", ge=0)] \
        = ports.REGISTRY_METRICS
    watch_interval: Annotated[float, option(
        "seconds between checks of the inputs for changes; 0 reloads only on SIGHUP",
        ge=0)] = 0.5
    resync_interval: Annotated[float, option(
        "seconds between checks that the bucket still holds the desired state; 0 checks only "
        "after changes and reconnects", ge=0)] = 30.0
    kubernetes: Annotated[bool, option(
        "read InferencePools, their Pods, InferenceObjectives, InferenceModelRewrites and "
        "InferenceModels from the Kubernetes API server (list+watch) instead of PATHs "
        "(docs/kubernetes.md)")] = False
    namespace: Annotated[str | None, option(
        "Kubernetes namespace to watch (default: the kubeconfig context's, or the pod's own in "
        "a cluster)")] = None
    kubeconfig: Annotated[str | None, option(
        "kubeconfig file (default: the pod's service account)", aliases=("KUBECONFIG",))] = None
    nats: NatsSettings = NatsSettings()
    log_level: LogLevel = "INFO"

    def __post_init__(self) -> None:
        if self.kubernetes and (self.paths or self.check or self.endpoints_override):
            raise ValueError("--kubernetes (env LIG_KUBERNETES) takes no PATH (LIG_PATHS), --check "
                             "or --endpoints-override")
        if not self.paths and not self.kubernetes:
            raise ValueError("no PATH given (or set LIG_PATHS)")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the registry's flags (one per :class:`RegistrySettings` field)."""
    add_flags(parser, RegistrySettings)


def settings_from(args: argparse.Namespace) -> RegistrySettings:
    """Validated settings: flags, else ``LIG_*`` variables, else defaults."""
    settings: RegistrySettings = from_args(RegistrySettings, args)
    return settings


def run(args: argparse.Namespace) -> int:
    """Validate (``--check``) or serve until SIGTERM."""
    settings = settings_from(args)
    if settings.check:
        return check(settings.paths, sys.stdout, sys.stderr)
    try:
        override = (read_override(settings.endpoints_override)
                    if settings.endpoints_override else None)
    except OverrideError as exc:
        raise ConfigError(f"--endpoints-override {exc}") from None
    setup_logging("registry", settings.log_level)
    return run_service(partial(_serve, settings, override))


async def _serve(settings: RegistrySettings, override: EndpointsOverride | None,
                 stop: asyncio.Event) -> int:
    metrics = RegistryMetrics()
    source: KubeSource | None = None
    if settings.kubernetes:
        kube = KubeReconciler(KubeState(), metrics, resync_interval=settings.resync_interval)
        source = KubeSource(make_client(settings.kubeconfig, settings.namespace),
                            kube.state, kube.request_reload)
        reconciler: Reconciler = kube
    else:
        reconciler = Reconciler(settings.paths, metrics, watch_interval=settings.watch_interval,
                                resync_interval=settings.resync_interval,
                                allow_empty=settings.allow_empty, override=override)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reconciler.request_reload)
    if override is not None:
        log.info("pool %s: its %d endpoint(s) come from %s, not from the inputs", override.pool,
                 len(override.endpoints), settings.endpoints_override)
    if source is None:
        # Validate before connecting, so that input errors show even while NATS is unreachable.
        await reconciler.check_inputs()
    async with Lifespan() as life:
        life.metrics_server(settings.host, settings.metrics_port, metrics.prometheus)
        work = life.task(_publish_forever(settings, reconciler, source, stop))
        stopping = life.task(stop.wait())
        await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if work.done() and not work.cancelled() and work.exception() is not None:
        # e.g. NATS refused our credentials: say so instead of dying silently
        log.error("registry failed", exc_info=work.exception())
        code = 1
    log.info("registry stopped")
    return code


async def _publish_forever(settings: RegistrySettings, reconciler: Reconciler,
                           source: KubeSource | None, stop: asyncio.Event) -> None:
    nats = settings.nats

    async def on_reconnect() -> None:
        reconciler.request_resync()

    async with connection(nats, "lig-registry", stop, on_reconnect=on_reconnect,
                          close_within=1.0) as nc:
        if nc is None:
            return
        warn_about_replication(nc, nats.replicas, "registry")
        bucket = Subjects(nats.prefix).registry_bucket
        metrics_at = (f"http://{settings.host}:{settings.metrics_port}/metrics"
                      if settings.metrics_port else "disabled")
        watching = (f"Kubernetes namespace {source.namespace}" if source is not None
                    else ", ".join(reconciler.paths))
        log.info("ready: watching %s, publishing to KV bucket %s at %s; metrics %s",
                 watching, bucket, nats.url, metrics_at)
        publishing = reconciler.run(Publisher(nc.jetstream(), bucket, nats.replicas))
        if source is None:
            await publishing
            return
        async with asyncio.TaskGroup() as group:
            group.create_task(publishing)
            group.create_task(_sync_then_publish(source, reconciler))
            await source.run()


async def _sync_then_publish(source: KubeSource, reconciler: Reconciler) -> None:
    """Let the Kubernetes reconciler publish once every kind has been listed."""
    await source.synced.wait()
    assert isinstance(reconciler, KubeReconciler)
    reconciler.synced = True
    reconciler.request_reload()
