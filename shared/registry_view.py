"""The registry as the other services see it: a view rebuilt from the JetStream KV bucket.

:class:`RegistryView` is pure state (apply a KV entry, read pools/models/endpoints).
:class:`RegistryWatcher` keeps a view in sync with the bucket. After a NATS reconnect the watch
is re-created and the whole view rebuilt from a fresh snapshot, because nats-py's ordered-consumer
watch can stall for several seconds after a server restart and deletes made meanwhile would be
missed otherwise.

Updates are applied to the view as they arrive, but the callbacks run at most once per event-loop
turn, with the names that changed meanwhile (:class:`RegistryChanges`): a registry publishing
10,000 models costs its subscribers one pass over what changed, not a rebuild per entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TypeVar

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

from shared.schemas import (
    DecodeError,
    EndpointSet,
    InferenceModel,
    InferencePool,
    Versioned,
    decode,
)
from shared.subjects import unescape_token
from shared.waits import wait_set

V = TypeVar("V", bound=Versioned)

log = logging.getLogger("lig.registry_view")

_DELETE_OPS = frozenset({"DEL", "PURGE"})
# Entries applied before the watch lets other tasks run: bounds how long a burst holds the loop.
_ENTRIES_PER_TURN = 256


class RegistryChanges(msgspec.Struct):
    """The names whose registry entries changed (set or deleted); ``everything`` after a
    (re)sync, when the whole view was replaced."""

    everything: bool = False
    pools: set[str] = msgspec.field(default_factory=set)
    models: dict[str, set[str]] = msgspec.field(default_factory=dict)  # pool -> model names
    endpoints: set[str] = msgspec.field(default_factory=set)

    def __bool__(self) -> bool:
        return self.everything or bool(self.pools or self.models or self.endpoints)


class RegistryView:
    """Pools, models and endpoint sets by pool name, as last published by the registry."""

    def __init__(self) -> None:
        self.pools: dict[str, InferencePool] = {}
        self.models: dict[str, dict[str, InferenceModel]] = {}
        self.endpoints: dict[str, EndpointSet] = {}

    def apply(self, key: str, value: bytes | None,
              changes: RegistryChanges | None = None) -> None:
        """Apply one KV entry (``value=None`` deletes), noting its name in ``changes``;
        DecodeError for a bad key or value (then nothing changes)."""
        kind, _, rest = key.partition(".")
        if kind == "pool":
            pool = unescape_token(rest)
            self._set(self.pools, pool, value, InferencePool)
            if changes is not None:
                changes.pools.add(pool)
        elif kind == "endpoints":
            pool = unescape_token(rest)
            self._set(self.endpoints, pool, value, EndpointSet)
            if changes is not None:
                changes.endpoints.add(pool)
        elif kind == "model":
            pool_token, _, model_token = rest.partition(".")
            if not model_token:
                raise DecodeError(f"malformed registry key {key!r}")
            pool, model = unescape_token(pool_token), unescape_token(model_token)
            self._set(self.models.setdefault(pool, {}), model, value, InferenceModel)
            if changes is not None:
                changes.models.setdefault(pool, set()).add(model)
        else:
            raise DecodeError(f"unknown registry key {key!r}")

    @staticmethod
    def _set(table: dict[str, V], name: str, value: bytes | None, message_type: type[V]) -> None:
        if value is None:
            table.pop(name, None)
        else:
            table[name] = decode(value, message_type)

    def replace_with(self, other: RegistryView) -> None:
        """Take ``other``'s contents (used after a resync), keeping this object's identity."""
        self.pools, self.models, self.endpoints = other.pools, other.models, other.endpoints


class RegistryWatcher:
    """Keeps a :class:`RegistryView` in sync with the registry bucket until stopped.

    ``on_change`` runs after the initial snapshot and after updates, at most once per event-loop
    turn (entries arriving in a burst are applied together); ``on_changes``, when given, runs
    just before it with the names changed since its previous call. ``on_undecodable`` is called
    (and the entry skipped) for entries that do not decode.
    """

    def __init__(
        self,
        js: JetStreamContext,
        bucket: str,
        view: RegistryView,
        on_change: Callable[[], None] = lambda: None,
        on_undecodable: Callable[[str, Exception], None] = lambda key, exc: None,
        retry_interval: float = 1.0,
        on_changes: Callable[[RegistryChanges], None] = lambda changes: None,
    ) -> None:
        self._js = js
        self._bucket = bucket
        self.view = view
        self._on_change = on_change
        self._on_changes = on_changes
        self._on_undecodable = on_undecodable
        self._retry_interval = retry_interval
        self._resync = asyncio.Event()
        self.synced = asyncio.Event()
        self._pending = RegistryChanges()
        self._flush_scheduled = False

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
                await wait_set(stop, self._retry_interval)

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
            self._pending = RegistryChanges(everything=True)
            self._flush()
            applied = 0
            async for entry in watcher:
                if entry is None:
                    continue
                self._apply(self.view, entry, self._pending)
                if not self._flush_scheduled:
                    # Runs on a later loop turn, once the entries already queued are applied
                    # (reading a non-empty queue does not yield): one pass per burst. It reads
                    # the view as it is then, so entries applied meanwhile are never missed.
                    asyncio.get_running_loop().call_soon(self._flush)
                    self._flush_scheduled = True
                applied += 1
                if applied % _ENTRIES_PER_TURN == 0:
                    await asyncio.sleep(0)  # requests waiting on the loop go first
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    def _flush(self) -> None:
        """Hand the changes gathered since the last call to the callbacks."""
        self._flush_scheduled = False
        changes, self._pending = self._pending, RegistryChanges()
        if not changes:
            return
        try:
            self._on_changes(changes)
            self._on_change()
        except Exception:  # a subscriber's bug must not stop the watch (nor vanish)
            log.exception("registry change callback failed")

    async def _bucket_when_ready(self) -> KeyValue:
        while True:
            try:
                return await self._js.key_value(self._bucket)
            except BucketNotFoundError:
                log.info("registry bucket %s not found yet; waiting for the registry",
                         self._bucket)
                await asyncio.sleep(self._retry_interval)

    def _apply(self, view: RegistryView, entry: KeyValue.Entry,
               changes: RegistryChanges | None = None) -> None:
        value = None if entry.operation in _DELETE_OPS else (entry.value or b"")
        try:
            view.apply(entry.key, value, changes)
        except DecodeError as exc:
            log.warning("skipping undecodable registry entry %s: %s", entry.key, exc)
            self._on_undecodable(entry.key, exc)
