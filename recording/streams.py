"""Reading a window of a JetStream stream in order, with an ephemeral pull consumer."""

from __future__ import annotations

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

log = logging.getLogger("lig.record")

BATCH = 1024
FETCH_TIMEOUT_S = 5.0
CONSUMER_IDLE_S = 30.0  # the server removes the consumer this long after the export stops
# Reply subjects of a JetStream delivery, and where sequence, time and pending count are:
# v1 $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
# v2 $JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>[...]
_V1_TOKENS = 9
_V1_FIELDS = (5, 7, 8)
_V2_FIELDS = (7, 9, 10)


class Stored(msgspec.Struct, frozen=True):
    """One stored message: its stream sequence, store time, subject, headers, body."""

    seq: int
    time_ns: int
    subject: str
    headers: dict[str, str] | None
    data: bytes


def delivery_fields(reply: str) -> tuple[int, int, int]:
    """``(stream sequence, store time in unix ns, messages still pending)`` from a JetStream
    delivery's reply subject (nats-py's metadata rounds the time through a float)."""
    tokens = reply.split(".")
    seq, stamp, pending = _V1_FIELDS if len(tokens) == _V1_TOKENS else _V2_FIELDS
    return int(tokens[seq]), int(tokens[stamp]), int(tokens[pending])


async def read_stream(js: JetStreamContext, stream: str, subject: str,
                      from_ns: int | None, to_ns: int) -> AsyncIterator[Stored]:
    """The messages of ``stream`` on ``subject`` stored after ``from_ns`` (from the first when
    None) and at or before ``to_ns``, oldest first. A missing stream yields nothing (logged):
    that recording was off."""
    try:
        await js.stream_info(stream)
    except NotFoundError:
        log.warning("stream %s does not exist: nothing recorded there", stream)
        return
    config = ConsumerConfig(ack_policy=AckPolicy.NONE, inactive_threshold=CONSUMER_IDLE_S,
                            mem_storage=True)
    if from_ns is None:
        config.deliver_policy = DeliverPolicy.ALL
    else:
        config.deliver_policy = DeliverPolicy.BY_START_TIME
        config.opt_start_time = datetime.datetime.fromtimestamp(
            from_ns / 1e9, datetime.UTC).isoformat().replace("+00:00", "Z")
    subscription = await js.pull_subscribe(subject, stream=stream, config=config)
    consumer = await subscription.consumer_info()
    try:
        pending = consumer.num_pending
        while pending > 0:
            try:
                batch: list[Msg] = await subscription.fetch(min(pending, BATCH),
                                                            FETCH_TIMEOUT_S)
            except TimeoutError:
                # The age or size limit may have removed what was pending when counted.
                pending = (await subscription.consumer_info()).num_pending
                if pending:
                    raise
                return
            for message in batch:
                seq, time_ns, pending = delivery_fields(message.reply)
                if from_ns is not None and time_ns <= from_ns:
                    continue
                if time_ns > to_ns:
                    return
                yield Stored(seq, time_ns, message.subject, message.headers, message.data)
    finally:
        await subscription.unsubscribe()
        # Gone after CONSUMER_IDLE_S anyway; deleting it now keeps the stream's list short.
        with contextlib.suppress(NatsError, TimeoutError):
            await js.delete_consumer(stream, consumer.name)
