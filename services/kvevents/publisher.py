"""Publishing block changes on NATS: numbered per pod-rank, held in order while NATS is away.

Every message a pod-rank's stream publishes gets the next ``stream_seq`` of that pod-rank when
it goes out, so the numbers NATS carries have no hole of the bridge's making. What NATS does not
take (disconnected, or the publish fails) waits in the :class:`~services.kvevents.outbox.Outbox`
and goes out, in order, as soon as NATS is back (the reconnect callback, or the next publish
that finds it connected); everything published meanwhile queues behind it. One lock orders all
of this: a pod-rank's messages leave in the order they were made.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.aio.client import Client

from services.kvevents.observability import KVEventsMetrics
from services.kvevents.outbox import Key, Outbox, key_of
from shared.kv_blocks import KVBlockChanges, encode
from shared.logs import RateLimitedLog
from shared.subjects import Subjects

log = logging.getLogger("lig.kv_events.publisher")

YIELD_EVERY = 1_000
"""Held messages sent between two turns of the event loop while draining (metrics, heartbeats
and the registry watch keep running)."""


class BlockPublisher:
    """Numbers, publishes and, while NATS is away, holds the bridge's block changes."""

    def __init__(self, subjects: Subjects, metrics: KVEventsMetrics, max_messages: int,
                 max_bytes: int) -> None:
        self._subjects = subjects
        self._metrics = metrics
        self.outbox = Outbox(max_messages, max_bytes)
        self._nc: Client | None = None
        self._next: dict[Key, int] = {}
        self._lock = asyncio.Lock()
        self._failures = RateLimitedLog(log)
        self._held_since: float | None = None
        metrics.buffered.set_function(lambda: self.outbox.messages)
        metrics.buffered_bytes.set_function(lambda: self.outbox.bytes)

    def attach(self, nc: Client) -> None:
        """Publish on ``nc`` from now on."""
        self._nc = nc

    def resume(self, key: Key, next_stream_seq: int) -> None:
        """Continue ``key``'s numbering at ``next_stream_seq`` (what the recording says an
        earlier bridge, or replica, published last, plus one)."""
        self._next[key] = next_stream_seq

    async def publish(self, changes: KVBlockChanges) -> None:
        """Publish ``changes`` behind anything held, or hold it; never raises."""
        async with self._lock:
            if self.outbox:
                await self._drain()
            if not self.outbox and await self._send(changes):
                return
            self._hold(changes)

    async def drain(self) -> None:
        """Send what is held, in order, while NATS takes it (NATS is back)."""
        async with self._lock:
            await self._drain()

    async def _drain(self) -> None:
        sent = 0
        while (changes := self.outbox.peek()) is not None:
            if not await self._send(changes):
                return
            self.outbox.pop()
            sent += 1
            if sent % YIELD_EVERY == 0:
                await asyncio.sleep(0)
        if sent and self._held_since is not None:
            log.info("NATS takes block changes again: published the %d held after %.1f s",
                     sent, time.monotonic() - self._held_since)
            self._held_since = None

    async def _send(self, changes: KVBlockChanges) -> bool:
        """Publish ``changes`` with its pod-rank's next number; False when NATS did not take
        it (the number is then not used)."""
        nc = self._nc
        if nc is None or not nc.is_connected:
            return False
        key = key_of(changes)
        number = self._next.get(key, 0)
        data = encode(msgspec.structs.replace(changes, stream_seq=number))
        try:
            await nc.publish(self._subjects.kv_blocks(changes.pool, changes.pod), data)
        except Exception as exc:  # held and retried, never fatal
            self._failures.warning("cannot publish block changes of %s/%s: %s", changes.pool,
                                   changes.pod, exc)
            return False
        self._next[key] = number + 1
        self._metrics.published.inc()
        if changes.resync:
            self._metrics.resyncs.inc()
        return True

    def _hold(self, changes: KVBlockChanges) -> None:
        outbox = self.outbox
        if not outbox:
            self._held_since = time.monotonic()
            log.warning("NATS does not take block changes: holding them (at most %d messages, "
                        "%d bytes) until it does", outbox.max_messages, outbox.max_bytes)
        self._metrics.publish_errors.inc()
        dropped = outbox.dropped
        for pool, pod, rank in outbox.put(changes, len(encode(changes)), time.time()):
            self._metrics.buffer_overflows.inc()
            log.warning("%s/%s rank %d: more block changes than the buffer holds while NATS is "
                        "away: replaced by a resync marker", pool, pod, rank)
        self._metrics.buffer_dropped.inc(outbox.dropped - dropped)
