"""Reading a window of a JetStream stream in order, with an ephemeral pull consumer."""

from __future__ import annotations

import datetime
import logging
from collections.abc import AsyncIterator

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

log = logging.getLogger("lig.record")

BATCH = 1024
FETCH_TIMEOUT_S = 5.0
CONSUMER_IDLE_S = 30.0  # the server removes the consumer this long after the export stops
_TS_FROM_END_V1 = 2  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
_V1_TOKENS = 9
_V2_TIMESTAMP = 9  # $JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>...


class Stored(msgspec.Struct, frozen=True):
    """One stored message: its stream sequence, store time, subject, headers, body."""

    seq: int
    time_ns: int
    subject: str
    headers: dict[str, str] | None
    data: bytes


def stored_time_ns(reply: str) -> tuple[int, int]:
    """``(stream sequence, store time in unix ns)`` from a JetStream delivery's reply subject
    (nats-py's metadata rounds the time through a float)."""
    tokens = reply.split(".")
    if len(tokens) == _V1_TOKENS:
        return int(tokens[5]), int(tokens[-_TS_FROM_END_V1])
    return int(tokens[7]), int(tokens[_V2_TIMESTAMP])


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
    try:
        pending = (await subscription.consumer_info()).num_pending
        while pending > 0:
            batch: list[Msg] = await subscription.fetch(min(pending, BATCH), FETCH_TIMEOUT_S)
            for message in batch:
                pending -= 1
                seq, time_ns = stored_time_ns(message.reply)
                if from_ns is not None and time_ns <= from_ns:
                    continue
                if time_ns > to_ns:
                    return
                yield Stored(seq, time_ns, message.subject, message.headers, message.data)
    finally:
        await subscription.unsubscribe()
