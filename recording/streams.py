"""Reading a window of a JetStream stream in order, with an ephemeral push consumer.

A push consumer with a callback costs nats-py ~7 µs of CPU per message; a pull consumer's
``fetch`` ~50 µs (a task and a ``wait_for`` per message), which made the export 6x slower
(measured with bench/bench_recording.py). Memory stays bounded: the callback waits when
:data:`BUFFER` messages are queued, which holds back the consumer's flow-control reply, so the
server stops sending until the export catches up.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections.abc import AsyncIterator

import msgspec
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from shared.errors import LigError
from shared.waits import within

log = logging.getLogger("lig.record")

BUFFER = 4096  # messages queued between the subscription and the export
WAIT_S = 10.0  # longest silence while messages are still pending (heartbeats come every 2 s)
HEARTBEAT_S = 2.0
CONSUMER_IDLE_S = 30.0  # the server removes the consumer this long after the export stops
# Reply subjects of a JetStream delivery, and where stream sequence, consumer sequence, time
# and pending count are:
# v1 $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
# v2 $JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>[...]
_V1_TOKENS = 9
_V1_FIELDS = (5, 6, 7, 8)
_V2_FIELDS = (7, 8, 9, 10)


class Stored(msgspec.Struct, frozen=True):
    """One stored message: its stream sequence, store time, subject, headers, body."""

    seq: int
    time_ns: int
    subject: str
    headers: dict[str, str] | None
    data: bytes


class Delivery(msgspec.Struct, frozen=True):
    """What a JetStream delivery's reply subject says (nats-py's metadata rounds the time
    through a float)."""

    stream_seq: int
    consumer_seq: int
    time_ns: int
    pending: int


class DeliveryGap(LigError, NatsError):
    """The consumer skipped messages (a slow-consumer drop): the export would miss them."""


def delivery_fields(reply: str) -> Delivery:
    """Parse a JetStream delivery's reply subject."""
    tokens = reply.split(".")
    stream_seq, consumer_seq, stamp, pending = \
        _V1_FIELDS if len(tokens) == _V1_TOKENS else _V2_FIELDS
    return Delivery(int(tokens[stream_seq]), int(tokens[consumer_seq]), int(tokens[stamp]),
                    int(tokens[pending]))


def _consumer_config(from_ns: int | None) -> ConsumerConfig:
    config = ConsumerConfig(ack_policy=AckPolicy.NONE, inactive_threshold=CONSUMER_IDLE_S,
                            mem_storage=True, num_replicas=1)
    if from_ns is None:
        config.deliver_policy = DeliverPolicy.ALL
    else:
        config.deliver_policy = DeliverPolicy.BY_START_TIME
        config.opt_start_time = datetime.datetime.fromtimestamp(from_ns / 1e9, datetime.UTC)
    return config


class _Window:
    """The subscription's callback side: queues the window's messages, then an end marker."""

    def __init__(self, from_ns: int | None, to_ns: int) -> None:
        self.from_ns = from_ns
        self.to_ns = to_ns
        self.queue: asyncio.Queue[Stored | Exception | None] = asyncio.Queue(BUFFER)
        self.ended = False
        self.last_consumer_seq = 0

    async def _end(self, reason: Exception | None = None) -> None:
        self.ended = True
        await self.queue.put(reason)

    async def on_message(self, message: Msg) -> None:
        if self.ended:
            return
        delivery = delivery_fields(message.reply)
        if delivery.consumer_seq != self.last_consumer_seq + 1:
            await self._end(DeliveryGap(f"messages {self.last_consumer_seq + 1}.."
                                        f"{delivery.consumer_seq - 1} were not delivered"))
            return
        self.last_consumer_seq = delivery.consumer_seq
        if delivery.time_ns > self.to_ns:
            await self._end()
            return
        if self.from_ns is None or delivery.time_ns > self.from_ns:
            await self.queue.put(Stored(delivery.stream_seq, delivery.time_ns, message.subject,
                                        message.headers, message.data))
        if delivery.pending == 0:
            await self._end()


async def read_stream(js: JetStreamContext, stream: str, subject: str,
                      from_ns: int | None, to_ns: int) -> AsyncIterator[Stored]:
    """The messages of ``stream`` on ``subject`` stored after ``from_ns`` (from the first when
    None) and at or before ``to_ns``, oldest first. A missing stream yields nothing (logged):
    that recording was off. DeliveryGap or TimeoutError if the server stops delivering."""
    try:
        await js.stream_info(stream)
    except NotFoundError:
        log.warning("stream %s does not exist: nothing recorded there", stream)
        return
    window = _Window(from_ns, to_ns)
    subscription = await js.subscribe(subject, stream=stream, cb=window.on_message,
                                      config=_consumer_config(from_ns), flow_control=True,
                                      idle_heartbeat=HEARTBEAT_S)
    consumer = await subscription.consumer_info()
    try:
        delivered = consumer.delivered.consumer_seq if consumer.delivered is not None else 0
        if consumer.num_pending == 0 and not delivered:
            return  # nothing stored after from_ns
        while True:
            try:
                item = window.queue.get_nowait()
            except asyncio.QueueEmpty:
                item = await _next(window, subscription, WAIT_S)
            if item is None:
                return
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        await subscription.unsubscribe()
        # Gone after CONSUMER_IDLE_S anyway; deleting it now keeps the stream's list short.
        with contextlib.suppress(NatsError, TimeoutError):
            await js.delete_consumer(stream, consumer.name)


async def _next(window: _Window, subscription: JetStreamContext.PushSubscription,
                seconds: float) -> Stored | Exception | None:
    """The next queued item, waiting up to ``seconds``; None if nothing is pending any more
    (the age or size limit removed what was pending when counted)."""
    try:
        return await within(window.queue.get(), seconds)
    except TimeoutError:
        if (await subscription.consumer_info()).num_pending == 0 and window.queue.empty():
            return None
        raise
