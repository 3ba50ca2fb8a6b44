"""Publishing a pool's registry state and pod metric snapshots to a real NATS, from a thread.

Stands in for the registry and collector services in picker tests and the picker benchmark:
registry objects go into the JetStream KV bucket the way the registry writes them, and each
pod's snapshot is re-published every ``interval`` (so it stays fresh) until paused. The thread
owns its own event loop, so synchronous tests and async ones alike can drive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Coroutine
from typing import Any

import msgspec
import nats
from nats.aio.client import Client
from nats.js.kv import KeyValue

from shared.schemas import Endpoint, EndpointSet, InferenceModel, InferencePool, PodMetrics, encode
from shared.subjects import Subjects, endpoints_key, model_key, pool_key


class PodFeed(msgspec.Struct):
    """What a pod reports in its next snapshots."""

    address: str
    fields: dict[str, Any] = {}
    paused: bool = False
    ok: bool = True
    seq: int = 0


class FleetFeed:
    """Registry state and metric snapshots of one pool, published to NATS from a thread."""

    def __init__(self, nats_url: str, pool: str, interval: float = 0.1,
                 prefix: str = "lig") -> None:
        self.nats_url = nats_url
        self.pool = pool
        self.interval = interval
        self.subjects = Subjects(prefix)
        self.pods: dict[str, PodFeed] = {}
        self.published = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fleet-feed",
                                        daemon=True)
        self._client: Client | None = None
        self._kv: KeyValue | None = None
        self._publisher: asyncio.Task[None] | None = None

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> FleetFeed:
        """Connect, create the registry bucket, start publishing snapshots."""
        self._thread.start()
        self._call(self._connect())
        return self

    def stop(self) -> None:
        """Stop publishing and close the connection."""
        with contextlib.suppress(Exception):
            self._call(self._close(), timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _connect(self) -> None:
        self._client = await nats.connect(self.nats_url, max_reconnect_attempts=-1,
                                          reconnect_time_wait=0.2, connect_timeout=2)
        js = self._client.jetstream()
        self._kv = await js.create_key_value(bucket=self.subjects.registry_bucket, history=1)
        self._publisher = asyncio.create_task(self._publish_forever())

    async def _close(self) -> None:
        if self._publisher is not None:
            self._publisher.cancel()
        if self._client is not None:
            await self._client.close()

    def _call(self, coroutine: Coroutine[Any, Any, Any], timeout: float = 10) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    # --- registry -----------------------------------------------------------------------

    def put(self, key: str, message: msgspec.Struct) -> None:
        """Write one registry entry (retrying while JetStream recovers from a restart)."""
        self._call(self._put(key, encode(message)), timeout=20)

    def delete(self, key: str) -> None:
        """Delete one registry entry."""
        self._call(self._put(key, None), timeout=20)

    async def _put(self, key: str, value: bytes | None) -> None:
        deadline = time.monotonic() + 15
        while True:
            try:
                assert self._client is not None
                self._kv = await self._client.jetstream().key_value(
                    self.subjects.registry_bucket)
                if value is None:
                    await self._kv.delete(key)
                else:
                    await self._kv.put(key, value)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)

    def set_pool(self, **fields: Any) -> InferencePool:
        """Publish the InferencePool (``target_port`` defaults to 8000)."""
        pool = InferencePool(name=self.pool, **{"target_port": 8000, **fields})
        self.put(pool_key(self.pool), pool)
        return pool

    def set_model(self, model_name: str, **fields: Any) -> InferenceModel:
        """Publish an InferenceModel of this pool."""
        model = InferenceModel(model_name=model_name, pool=self.pool, **fields)
        self.put(model_key(self.pool, model_name), model)
        return model

    def delete_model(self, model_name: str) -> None:
        """Remove an InferenceModel."""
        self.delete(model_key(self.pool, model_name))

    def set_endpoints(self, pods: dict[str, str]) -> None:
        """Publish the pool's members, ``{pod name: "ip:port"}``."""
        endpoints = []
        for name, address in pods.items():
            host, _, port = address.rpartition(":")
            endpoints.append(Endpoint(name=name, address=host, port=int(port)))
        self.put(endpoints_key(self.pool), EndpointSet(pool=self.pool, endpoints=tuple(endpoints)))

    # --- metrics ------------------------------------------------------------------------

    def set_metrics(self, pod: str, address: str, ok: bool = True, **fields: Any) -> None:
        """From now on, publish these metrics for ``pod`` (and resume it if paused)."""
        self.set_many({pod: (address, {"ok": ok, **fields})})

    def set_many(self, pods: dict[str, tuple[str, dict[str, Any]]]) -> None:
        """Change several pods at once, ``{pod: (address, fields)}`` (one publication)."""
        with self._lock:
            for pod, (address, fields) in pods.items():
                feed = self.pods.setdefault(pod, PodFeed(address))
                feed.address, feed.ok, feed.paused = address, fields.pop("ok", True), False
                feed.fields = fields
        self._loop.call_soon_threadsafe(self._wake)

    def pause(self, pod: str) -> None:
        """Stop publishing ``pod``'s snapshots (its newest one goes stale)."""
        with self._lock:
            self.pods[pod].paused = True

    def _wake(self) -> None:
        self._publish_once()

    async def _publish_forever(self) -> None:
        while True:
            self._publish_once()
            await asyncio.sleep(self.interval)

    def _publish_once(self) -> None:
        if self._client is None or not self._client.is_connected:
            return
        with self._lock:
            batch = []
            for name, feed in self.pods.items():
                if feed.paused:
                    continue
                feed.seq += 1
                batch.append(PodMetrics(
                    pool=self.pool, pod=name, address=feed.address, seq=feed.seq,
                    scrape_time_ns=time.time_ns(), scrape_duration_s=0.001, ok=feed.ok,
                    error=None if feed.ok else "scrape failed", **feed.fields))
        for snapshot in batch:
            # publish() only buffers; the client's flusher sends it.
            self._loop.create_task(self._client.publish(
                self.subjects.metrics(self.pool, snapshot.pod), encode(snapshot)))
        self.published += len(batch)
