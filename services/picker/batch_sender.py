"""Publishing what the request path produces, in batches per pool, off the request path.

One :class:`BatchSender` task serves several :class:`BatchQueue` s, one per kind of message (the
decision stream's events, the flight recorder's records). On the request path a queue only
appends the item to its pool's pending list and, for the first item of a window, wakes the
sender. The sender waits ``delay`` for more, then publishes at most one message per queue and
pool (``max_batch`` items, and no more bytes than the server accepts: a larger batch is split,
a single item too large for any message is dropped). Each queue is bounded (``max_pending``):
beyond that, and while NATS is away, items are dropped and counted, never queued without bound
and never blocking a request.

A queue with ``heartbeat`` set also publishes an empty batch for every pool it has published to
once that pool has been quiet for the sender's ``heartbeat`` seconds, so that consumers can tell
a quiet publisher from a dead one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from nats.aio.client import Client

from shared.logs import RateLimitedLog

log = logging.getLogger("lig.picker.batch_sender")

DEFAULT_DELAY = 0.002  # seconds an item may wait for others to share its message
DEFAULT_HEARTBEAT = 0.5  # seconds between empty batches of a quiet queue
MAX_PENDING = 10_000  # items of one queue waiting to be published, over every pool
MAX_BATCH = 256  # items per message

Item = TypeVar("Item")
# (pool, wall clock in unix ns, items) -> the encoded message
Wrap = Callable[[str, int, list[Item]], bytes]


class BatchQueue(Generic[Item]):
    """The pending items of one kind of message, per pool; call it as ``queue(pool, item)``.

    ``subject(pool)`` names where a pool's batches go, ``wrap`` encodes one batch.
    ``on_published(n)`` and ``on_dropped(reason, n)`` count items once per batch (reasons:
    ``queue_full``, ``nats_away``, ``too_large``).
    """

    def __init__(self, sender: BatchSender, subject: Callable[[str], str], wrap: Wrap[Item], *,
                 heartbeat: bool, max_pending: int,
                 on_published: Callable[[int], None],
                 on_dropped: Callable[[str, int], None]) -> None:
        self._sender = sender
        self._subject_of = subject
        self._wrap = wrap
        self.heartbeat = heartbeat
        self._max_pending = max_pending
        self._on_published = on_published
        self._on_dropped = on_dropped
        self._pending: dict[str, list[Item]] = {}
        self._count = 0
        self._full = 0  # items dropped since the last flush because the queue was full
        self._last_sent: dict[str, float] = {}  # pool -> monotonic time of its last message
        self._subject: dict[str, str] = {}
        self._errors = RateLimitedLog(log)

    def __call__(self, pool: str, item: Item) -> None:
        """Queue one item (the request path: no I/O, no allocation beyond the append)."""
        if self._count >= self._max_pending:
            self._full += 1
            return
        pending = self._pending.get(pool)
        if pending is None:
            pending = self._pending[pool] = []
        pending.append(item)
        self._count += 1
        sender = self._sender
        if not sender.armed:
            sender.arm()

    def take(self) -> dict[str, list[Item]]:
        """The pending items per pool, leaving none pending (the sender's next batch)."""
        pending = self._pending
        self._pending = {}
        self._count = 0
        return pending

    async def flush(self, client: Client, now: float, heartbeat: float) -> None:
        """Publish what is pending now, then (``heartbeat`` queues) empty batches for pools
        quiet for ``heartbeat`` seconds."""
        batches = self.take()
        if self._full:
            self._on_dropped("queue_full", self._full)
            self._full = 0
        step = self._sender.max_batch
        for pool, items in batches.items():
            for start in range(0, len(items), step):
                await self._publish(client, pool, items[start:start + step], now)
        if self.heartbeat:
            for pool, sent in list(self._last_sent.items()):
                if now - sent >= heartbeat:
                    await self._publish(client, pool, [], now)

    async def _publish(self, client: Client, pool: str, items: list[Item], now: float) -> None:
        self._last_sent[pool] = now
        if not client.is_connected:
            if items:
                self._on_dropped("nats_away", len(items))
            return
        subject = self._subject.get(pool)
        if subject is None:
            subject = self._subject[pool] = self._subject_of(pool)
        payload = self._wrap(pool, time.time_ns(), items)
        if len(payload) > client.max_payload and items:
            if len(items) == 1:  # nothing smaller to send: count it rather than fail forever
                self._errors.warning("dropping an item of pool %s: %d bytes encoded, more than "
                                     "the server's max_payload %d", pool, len(payload),
                                     client.max_payload)
                self._on_dropped("too_large", 1)
                return
            half = len(items) // 2
            await self._publish(client, pool, items[:half], now)
            await self._publish(client, pool, items[half:], now)
            return
        try:
            await client.publish(subject, payload)
        except Exception as exc:  # a connection closing under us: the items are lost
            self._errors.warning("cannot publish on %s: %s", subject, exc)
            if items:
                self._on_dropped("nats_away", len(items))
            return
        if items:
            self._on_published(len(items))


class BatchSender:
    """The one task that publishes every queue's batches (see the module doc).

    ``picker_id`` names the publisher in its messages; :meth:`queue` adds a kind of message;
    :meth:`run` is the sender task.
    """

    def __init__(self, picker_id: str, delay: float = DEFAULT_DELAY,
                 heartbeat: float = DEFAULT_HEARTBEAT, max_batch: int = MAX_BATCH) -> None:
        self.picker_id = picker_id
        self.delay = delay
        self.heartbeat = heartbeat
        self.max_batch = max_batch
        self.armed = False
        self._wake = asyncio.Event()
        self._queues: list[BatchQueue[object]] = []

    def queue(self, subject: Callable[[str], str], wrap: Wrap[Item], *, heartbeat: bool = False,
              max_pending: int = MAX_PENDING,
              on_published: Callable[[int], None] = lambda count: None,
              on_dropped: Callable[[str, int], None] = lambda reason, count: None
              ) -> BatchQueue[Item]:
        """A new queue whose batches this sender publishes (arguments: see
        :class:`BatchQueue`)."""
        queue: BatchQueue[Item] = BatchQueue(
            self, subject, wrap, heartbeat=heartbeat, max_pending=max_pending,
            on_published=on_published, on_dropped=on_dropped)
        self._queues.append(queue)  # type: ignore[arg-type]
        return queue

    def arm(self) -> None:
        """The first item of a window arrived: wake the sender."""
        self.armed = True
        self._wake.set()

    async def run(self, client: Client) -> None:
        """Publish batches on ``client`` until cancelled."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.heartbeat):
                    await self._wake.wait()
            if self._wake.is_set():
                await asyncio.sleep(self.delay)  # let the window's other items join
            await self.flush(client)

    async def flush(self, client: Client) -> None:
        """Publish what every queue holds now, and the heartbeats that are due."""
        self.armed = False
        self._wake.clear()
        now = time.monotonic()
        for queue in self._queues:
            await queue.flush(client, now, self.heartbeat)
