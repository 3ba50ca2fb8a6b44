"""The decision stream on NATS: publish this picker's decisions in batches, receive its peers'.

Contract: docs/decision-stream.md. The publisher is the gateway's ``on_decision`` callback; on
the request path it only appends the event to its pool's pending list (and, for the first event
of a batch, wakes the sender task). The sender waits ``delay`` for more decisions, then publishes
at most one message per pool and batch (``max_batch`` events; more make more messages). The
pending events are bounded (``max_pending``): beyond that, and while NATS is away, events are
dropped and counted, never queued without bound; peers forget what they miss by expiry.

With nothing to say for ``heartbeat`` seconds the sender publishes an empty batch for every pool
it has published to, so that peers can tell a quiet picker from a dead one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from nats.aio.client import Client
from nats.aio.subscription import Subscription

from services.picker.feeds import subscribe_each
from shared.logs import RateLimitedLog
from shared.schemas import DecisionBatch, DecisionEvent, DecodeError, decode, encode
from shared.subjects import Subjects

log = logging.getLogger("lig.picker.decision_stream")

DEFAULT_DELAY = 0.002  # seconds a decision may wait for others to share its message
DEFAULT_HEARTBEAT = 0.5  # seconds between empty batches of a quiet picker
MAX_PENDING = 10_000  # events waiting to be published, over every pool
MAX_BATCH = 256  # events per message (a 4,000-token prompt's hashes are ~2 KB of it)


class DecisionPublisher:
    """Batches this picker's decisions per pool and publishes them (see the module doc).

    Call it as ``on_decision(pool, event)``; :meth:`run` is the sender task.
    ``on_published(n)`` and ``on_dropped(reason, n)`` count events (reasons: ``queue_full``,
    ``nats_away``), once per batch, not per event.
    """

    def __init__(self, picker_id: str, subjects: Subjects, delay: float = DEFAULT_DELAY,
                 heartbeat: float = DEFAULT_HEARTBEAT, max_pending: int = MAX_PENDING,
                 max_batch: int = MAX_BATCH,
                 on_published: Callable[[int], None] = lambda count: None,
                 on_dropped: Callable[[str, int], None] = lambda reason, count: None) -> None:
        self.picker_id = picker_id
        self._subjects = subjects
        self.delay = delay
        self.heartbeat = heartbeat
        self._max_pending = max_pending
        self._max_batch = max_batch
        self._on_published = on_published
        self._on_dropped = on_dropped
        self._pending: dict[str, list[DecisionEvent]] = {}
        self._count = 0
        self._full = 0  # events dropped since the last flush because the queue was full
        self._armed = False
        self._wake = asyncio.Event()
        self._last_sent: dict[str, float] = {}  # pool -> monotonic time of its last message
        self._subject: dict[str, str] = {}
        self._errors = RateLimitedLog(log)

    def __call__(self, pool: str, event: DecisionEvent) -> None:
        """Queue one decision (the request path: no I/O, no allocation beyond the append)."""
        if self._count >= self._max_pending:
            self._full += 1
            return
        pending = self._pending.get(pool)
        if pending is None:
            pending = self._pending[pool] = []
        pending.append(event)
        self._count += 1
        if not self._armed:
            self._armed = True
            self._wake.set()

    def take(self) -> dict[str, list[DecisionEvent]]:
        """The pending events per pool, leaving none pending (the sender's next batch)."""
        pending = self._pending
        self._pending = {}
        self._count = 0
        self._armed = False
        self._wake.clear()
        return pending

    async def run(self, client: Client) -> None:
        """Publish batches on ``client`` until cancelled."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.heartbeat):
                    await self._wake.wait()
            if self._wake.is_set():
                await asyncio.sleep(self.delay)  # let the window's other decisions join
            await self.flush(client)

    async def flush(self, client: Client) -> None:
        """Publish what is pending now, then heartbeats for pools quiet for too long."""
        batches = self.take()
        if self._full:
            self._on_dropped("queue_full", self._full)
            self._full = 0
        now = time.monotonic()
        for pool, events in batches.items():
            for start in range(0, len(events), self._max_batch):
                await self._publish(client, pool, events[start:start + self._max_batch], now)
        for pool, sent in list(self._last_sent.items()):
            if now - sent >= self.heartbeat:
                await self._publish(client, pool, [], now)

    async def _publish(self, client: Client, pool: str, events: list[DecisionEvent],
                       now: float) -> None:
        self._last_sent[pool] = now
        if not client.is_connected:
            if events:
                self._on_dropped("nats_away", len(events))
            return
        subject = self._subject.get(pool)
        if subject is None:
            subject = self._subject[pool] = self._subjects.decisions(pool)
        batch = DecisionBatch(self.picker_id, pool, time.time_ns(), events, self.heartbeat)
        try:
            await client.publish(subject, encode(batch))
        except Exception as exc:  # a connection closing under us: the events are lost
            self._errors.warning("cannot publish decisions of pool %s: %s", pool, exc)
            if events:
                self._on_dropped("nats_away", len(events))
            return
        if events:
            self._on_published(len(events))


class DecisionSink:
    """Decodes one decision payload and hands it to ``apply`` (the gateway's ``apply_peer``);
    undecodable payloads are counted (``on_undecodable``), logged and skipped."""

    def __init__(self, apply: Callable[[DecisionBatch], None],
                 on_undecodable: Callable[[], None] = lambda: None) -> None:
        self._apply = apply
        self._on_undecodable = on_undecodable
        self._bad = RateLimitedLog(log)

    def accept(self, subject: str, data: bytes) -> None:
        """Apply one payload received on ``subject``; count and skip it when it is bad."""
        try:
            batch = decode(data, DecisionBatch)
        except DecodeError as exc:
            self._on_undecodable()
            self._bad.warning("skipping decisions message on %s: %s", subject, exc)
            return
        self._apply(batch)


async def subscribe_decisions(client: Client, subjects: Subjects, sink: DecisionSink,
                              pools: Sequence[str]) -> list[Subscription]:
    """Feed every decision batch of ``pools`` (empty: of every pool) into ``sink``."""

    names = [subjects.decisions(pool) for pool in pools] or [subjects.all_decisions()]
    return await subscribe_each(client, names, sink.accept)
