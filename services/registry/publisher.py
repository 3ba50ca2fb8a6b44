"""Making the JetStream KV bucket hold exactly the desired registry, writing only differences.

Keys (``shared.subjects``): ``pool.<pool>``, ``endpoints.<pool>``, ``model.<pool>.<model>``;
values are ``shared.schemas.encode(...)`` of the wire messages. A pass reads the bucket's current
values, puts the keys whose bytes differ and deletes (a KV delete marker, kept in the history) the
managed keys no longer desired. Writes are idempotent, so several registry instances with the same
inputs converge on the same bucket without rewriting it. Puts go pools first and models last,
deletes the other way round, so a watcher never sees a model whose pool is missing. A pass that
would remove every pool, or every endpoint of a pool, is refused before anything is written
(:mod:`.guard`) unless the caller allows it. The bucket is kept at the configured number of
replicas (:mod:`shared.replication`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TypeVar

import msgspec
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.client import KV_PRE_TEMPLATE, KV_STREAM_TEMPLATE
from nats.js.errors import BadRequestError, BucketNotFoundError, KeyNotFoundError
from nats.js.kv import KeyValue

from services.registry.guard import Refusal, removal_refusal
from services.registry.loader import Registry
from shared.errors import LigError
from shared.logs import RateLimitedLog
from shared.replication import ReplicaAlignmentError, align_replicas
from shared.schemas import encode
from shared.subjects import endpoints_key, model_key, pool_key

log = logging.getLogger("lig.registry.publisher")

# Key families the registry owns; keys outside them are left alone.
_ORDER = ("pool.", "endpoints.", "model.")
HISTORY = 5
# Requests a pass keeps in flight: one at a time, 10,000 models cost 10,000 round trips in a row
# (bench/bench_registry_publish.py).
CONCURRENCY = 128

T = TypeVar("T")
R = TypeVar("R")


class Plan(msgspec.Struct, frozen=True):
    """What a pass must write: puts and deletes in a safe order, and how many keys are equal."""

    puts: tuple[tuple[str, bytes], ...] = ()
    deletes: tuple[str, ...] = ()
    unchanged: int = 0


def desired_entries(registry: Registry) -> dict[str, bytes]:
    """The bucket contents that represent ``registry``."""
    entries = {pool_key(p.name): encode(p) for p in registry.pools}
    entries |= {endpoints_key(e.pool): encode(e) for e in registry.endpoint_sets}
    entries |= {model_key(m.pool, m.model_name): encode(m) for m in registry.models}
    return entries


def plan(desired: Mapping[str, bytes], current: Mapping[str, bytes]) -> Plan:
    """Compare desired with current bucket contents (deleted keys absent from both)."""
    puts = sorted(
        ((key, value) for key, value in desired.items() if current.get(key) != value),
        key=lambda item: _rank(item[0]),
    )
    deletes = sorted(
        (key for key in current if key not in desired and _rank(key) < len(_ORDER)),
        key=lambda key: -_rank(key),
    )
    unchanged = sum(1 for key, value in desired.items() if current.get(key) == value)
    return Plan(tuple(puts), tuple(deletes), unchanged)


def _rank(key: str) -> int:
    return next((i for i, prefix in enumerate(_ORDER) if key.startswith(prefix)), len(_ORDER))


class RemovalRefused(LigError):
    """A pass wrote nothing because it would have removed every pool or a pool's endpoints."""

    def __init__(self, refusal: Refusal) -> None:
        self.refusal = refusal
        super().__init__(refusal.message)


class Publisher:
    """Publishes desired registries into one bucket, creating the bucket when it is missing and
    keeping it at ``replicas`` copies."""

    def __init__(self, js: JetStreamContext, bucket: str, replicas: int = 1,
                 concurrency: int = CONCURRENCY) -> None:
        self._js = js
        self._bucket = bucket
        self._replicas = replicas
        self._concurrency = concurrency
        self._replica_errors = RateLimitedLog(log, interval=60.0)

    async def publish(self, registry: Registry, *, allow_empty: bool = False) -> Plan:
        """Make the bucket equal to ``registry``; return what was written.

        Raise :class:`RemovalRefused`, writing nothing, when that would remove every pool or
        every endpoint of a pool, unless ``allow_empty``.
        """
        kv = await self._open_bucket()
        current = {key: entry.value or b"" for key, entry in
                   (await read_bucket(self._js, self._bucket, self._concurrency)).items()}
        desired = desired_entries(registry)
        refusal = None if allow_empty else removal_refusal(desired, current)
        if refusal is not None:
            raise RemovalRefused(refusal)
        todo = plan(desired, current)
        # Each family is finished before the next starts, keeping the pools-first order.
        for _, puts in itertools.groupby(todo.puts, key=lambda item: _rank(item[0])):
            await in_batches(lambda item: kv.put(*item), puts, self._concurrency)
        for _, deletes in itertools.groupby(todo.deletes, key=_rank):
            await in_batches(kv.delete, deletes, self._concurrency)
        return todo

    async def _open_bucket(self) -> KeyValue:
        # Looked up on every pass: after a NATS restart with a fresh store the bucket is gone.
        try:
            kv = await self._js.key_value(self._bucket)
        except BucketNotFoundError:
            pass
        else:
            await self._align_replicas()
            return kv
        config = KeyValueConfig(
            bucket=self._bucket, history=HISTORY, description="lig: pools, models, endpoints",
            replicas=self._replicas,
        )
        try:
            kv = await self._js.create_key_value(config)
        except BadRequestError as refused:
            # Another instance created it first, perhaps with other settings: use theirs. If it
            # does not exist, the server's reason (e.g. "no suitable peers for placement" for
            # more replicas than the cluster can place) is the error worth reporting.
            try:
                return await self._js.key_value(self._bucket)
            except BucketNotFoundError:
                raise refused from None
        log.info("created KV bucket %s (history %d, %d replicas)", self._bucket, HISTORY,
                 self._replicas)
        return kv

    async def _align_replicas(self) -> None:
        # A count the cluster cannot place must not stop publishing: the bucket keeps its count.
        try:
            await align_replicas(self._js, KV_STREAM_TEMPLATE.format(bucket=self._bucket),
                                 self._replicas)
        except ReplicaAlignmentError as exc:
            self._replica_errors.warning("KV bucket %s: cannot change to %d replicas: %s",
                                         self._bucket, self._replicas, exc)


async def read_bucket(
    js: JetStreamContext, bucket: str, concurrency: int = CONCURRENCY
) -> dict[str, KeyValue.Entry]:
    """The latest entry of every live key of ``bucket``.

    Lists the stream's subjects, then gets each key, ``concurrency`` at a time. (A KV watcher
    would be one pass, but nats-py's watcher can signal "no more values" before delivering them
    when the server is quick, which would make live keys look absent.)
    """
    kv = await js.key_value(bucket)
    prefix = KV_PRE_TEMPLATE.format(bucket=bucket)
    info = await js.stream_info(KV_STREAM_TEMPLATE.format(bucket=bucket), subjects_filter=">")

    async def get(key: str) -> KeyValue.Entry | None:
        try:
            return await kv.get(key)
        except KeyNotFoundError:  # its newest message is a delete or purge marker
            return None

    keys = [subject.removeprefix(prefix) for subject in sorted(info.state.subjects or {})]
    found = await in_batches(get, keys, concurrency)
    return {key: entry for key, entry in zip(keys, found, strict=True) if entry is not None}


async def in_batches(call: Callable[[T], Awaitable[R]], items: Iterable[T], size: int) -> list[R]:
    """``call`` on every item, ``size`` calls in flight at a time; the results in order."""
    pending, results = list(items), []
    for start in range(0, len(pending), size):
        results += await asyncio.gather(*(call(item) for item in pending[start:start + size]))
    return results
