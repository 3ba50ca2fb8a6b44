"""Helpers for the collector's tests: registry entries, a snapshot recorder, collector runs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from services.collector.main import Collector, CollectorSettings
from shared.nats_connection import NatsSettings
from shared.schemas import Endpoint, EndpointSet, InferencePool, PodMetrics, decode, encode
from shared.subjects import Subjects, endpoints_key, pool_key
from tests.support.processes import die_with_parent

SUBJECTS = Subjects()
LIG = Path(sys.executable).with_name("lig")


async def registry_bucket(nc: Client) -> KeyValue:
    """The registry's KV bucket, created as the registry service creates it."""
    return await nc.jetstream().create_key_value(bucket=SUBJECTS.registry_bucket, history=5)


async def put_pool(kv: KeyValue, pool: InferencePool, endpoints: list[Endpoint]) -> None:
    """Publish a pool and its endpoints the way the registry does."""
    await kv.put(pool_key(pool.name), encode(pool))
    await kv.put(endpoints_key(pool.name),
                 encode(EndpointSet(pool=pool.name, endpoints=tuple(endpoints))))


def pod(name: str, port: int) -> Endpoint:
    """An endpoint on loopback."""
    return Endpoint(name=name, address="127.0.0.1", port=port)


class SnapshotLog:
    """Every snapshot received on ``lig.metrics.>``, with its receive time (time.time_ns)."""

    def __init__(self) -> None:
        self.received: list[tuple[int, PodMetrics]] = []

    async def on_message(self, msg: Msg) -> None:
        self.received.append((time.time_ns(), decode(msg.data, PodMetrics)))

    def of(self, pod_name: str) -> list[PodMetrics]:
        """The snapshots of one pod, in arrival order."""
        return [snapshot for _, snapshot in self.received if snapshot.pod == pod_name]

    def latest(self, pod_name: str) -> PodMetrics | None:
        snapshots = self.of(pod_name)
        return snapshots[-1] if snapshots else None


@contextlib.asynccontextmanager
async def snapshot_log(nc: Client) -> AsyncIterator[SnapshotLog]:
    """Record snapshots while the block runs."""
    log = SnapshotLog()
    subscription = await nc.subscribe(SUBJECTS.all_metrics(), cb=log.on_message)
    try:
        yield log
    finally:
        await subscription.unsubscribe()


def settings(nats_url: str, **overrides: object) -> CollectorSettings:
    """Collector settings for tests: relaxed cadence, no metrics port unless asked.

    The scrape timeout is 1 s (so the interval 1.1 s): the page servers run in the test's own
    process, and a loaded machine slows them; a test that checks a healthy pod's snapshot must
    not see a timeout instead.
    """
    relaxed = CollectorSettings(nats=NatsSettings(url=nats_url), collector_id="test-collector",
                                interval_s=1.1, scrape_timeout_s=1.0, max_backoff_s=4.4,
                                heartbeat_s=0.2, metrics_port=0)
    return msgspec.structs.replace(relaxed, **overrides)


@contextlib.asynccontextmanager
async def running_collector(collector_settings: CollectorSettings) -> AsyncIterator[Collector]:
    """A collector running in this event loop until the block ends."""
    collector = Collector(collector_settings)
    stop = asyncio.Event()
    task = asyncio.create_task(collector.run(stop))
    try:
        yield collector
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


@contextlib.contextmanager
def collector_process(nats_url: str, collector_id: str, *flags: str,
                      log_path: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """``lig collector`` as a subprocess; killed at the end if still running."""
    log_file = open(log_path, "wb") if log_path else None  # noqa: SIM115
    output = log_file if log_file is not None else subprocess.DEVNULL
    process = subprocess.Popen(
        [str(LIG), "collector", "--nats-url", nats_url, "--collector-id", collector_id,
         "--metrics-port", "0", *flags],
        stdout=output, stderr=output, env={**os.environ, "LIG_LOG_LEVEL": "INFO"},
        preexec_fn=die_with_parent,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()
        if log_file is not None:
            log_file.close()
