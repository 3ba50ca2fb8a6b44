"""The registry as the other services see it: a view rebuilt from the JetStream KV bucket.

:class:`RegistryView` is pure state (apply a KV entry, read pools/models/endpoints).
:class:`RegistryWatcher` keeps a view in sync with the bucket. After a NATS reconnect the watch
is re-created and the whole view rebuilt from a fresh snapshot, because nats-py's ordered-consumer
watch can stall for several seconds after a server restart and deletes made meanwhile would be
missed otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

from shared.schemas import DecodeError, EndpointSet, InferenceModel, InferencePool, decode
from shared.subjects import unescape_token

log = logging.getLogger("lig.registry_view")

_DELETE_OPS = frozenset({"DEL", "PURGE"})


class RegistryView:
    """Pools, models and endpoint sets by pool name, as last published by the registry."""

    def __init__(self) -> None:
        self.pools: dict[str, InferencePool] = {}
        self.models: dict[str, dict[str, InferenceModel]] = {}
        self.endpoints: dict[str, EndpointSet] = {}

    def apply(self, key: str, value: bytes | None) -> None:
        """Apply one KV entry (``value=None`` deletes); DecodeError for a bad key or value."""
        kind, _, rest = key.partition(".")
        if kind == "pool":
            self._set(self.pools, unescape_token(rest), value, InferencePool)
        elif kind == "endpoints":
            self._set(self.endpoints, unescape_token(rest), value, EndpointSet)
        elif kind == "model":
            pool_token, _, model_token = rest.partition(".")
            if not model_token:
                raise DecodeError(f"malformed registry key {key!r}")
            pool_models = self.models.setdefault(unescape_token(pool_token), {})
            self._set(pool_models, unescape_token(model_token), value, InferenceModel)
        else:
            raise DecodeError(f"unknown registry key {key!r}")

    @staticmethod
    def _set(table: dict, name: str, value: bytes | None, message_type: type) -> None:
        if value is None:
            table.pop(name, None)
        else:
            table[name] = decode(value, message_type)

    def replace_with(self, other: RegistryView) -> None:
        """Take ``other``'s contents (used after a resync), keeping this object's identity."""
        self.pools, self.models, self.endpoints = other.pools, other.models, other.endpoints


class RegistryWatcher:
    """Keeps a :class:`RegistryView` in sync with the registry bucket until stopped.

    ``on_change`` runs after the initial snapshot and after every applied update;
    ``on_undecodable`` is called (and the entry skipped) for entries that do not decode.
    """

    def __init__(
        self,
        js: JetStreamContext,
        bucket: str,
        view: RegistryView,
        on_change: Callable[[], None] = lambda: None,
        on_undecodable: Callable[[str, Exception], None] = lambda key, exc: None,
        retry_interval: float = 1.0,
    ) -> None:
        self._js = js
        self._bucket = bucket
        self.view = view
        self._on_change = on_change
        self._on_undecodable = on_undecodable
        self._retry_interval = retry_interval
        self._resync = asyncio.Event()
        self.synced = asyncio.Event()

    def resync(self) -> None:
        """Drop the current watch and rebuild the view (call from the NATS reconnect callback)."""
        self._resync.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Watch until ``stop`` is set, re-creating the watch on resync or failure."""
        while not stop.is_set():
            self._resync.clear()
            watch = asyncio.create_task(self._watch_once())
            waiters = [watch, asyncio.create_task(stop.wait()),
                       asyncio.create_task(self._resync.wait())]
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for task in waiters:
                task.cancel()
            for task in waiters:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if watch.done() and not watch.cancelled() and watch.exception() is not None:
                log.warning("registry watch failed: %s; retrying", watch.exception())
            if not stop.is_set() and not self._resync.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._retry_interval)

    async def _watch_once(self) -> None:
        kv = await self._bucket_when_ready()
        empty = (await kv.status()).values == 0
        watcher = await kv.watchall()
        try:
            snapshot = RegistryView()
            # nats-py can send its "initial values done" marker (None) before the values
            # themselves, so the snapshot ends with the entry that had nothing pending behind it.
            if not empty:
                async for entry in watcher:
                    if entry is None:
                        continue
                    self._apply(snapshot, entry)
                    if entry.delta == 0:
                        break
            self.view.replace_with(snapshot)
            self.synced.set()
            log.info("registry synced: %d pools, %d models, %d endpoint sets",
                     len(snapshot.pools), sum(map(len, snapshot.models.values())),
                     len(snapshot.endpoints))
            self._on_change()
            async for entry in watcher:
                if entry is not None:
                    self._apply(self.view, entry)
                    self._on_change()
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    async def _bucket_when_ready(self) -> KeyValue:
        while True:
            try:
                return await self._js.key_value(self._bucket)
            except BucketNotFoundError:
                log.info("registry bucket %s not found yet; waiting for the registry",
                         self._bucket)
                await asyncio.sleep(self._retry_interval)

    def _apply(self, view: RegistryView, entry: KeyValue.Entry) -> None:
        value = None if entry.operation in _DELETE_OPS else (entry.value or b"")
        try:
            view.apply(entry.key, value)
        except DecodeError as exc:
            log.warning("skipping undecodable registry entry %s: %s", entry.key, exc)
            self._on_undecodable(entry.key, exc)
