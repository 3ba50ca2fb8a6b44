"""The decision stream and the decision records on NATS: publish this picker's, receive its peers'
decisions.

Contracts: docs/decision-stream.md (events shared between replicas, ``<prefix>.decisions.<pool>``)
and docs/recording.md (the flight recorder's records, ``<prefix>.records.<pool>``). Both go out
through one :class:`~services.picker.batch_sender.BatchSender` (appended on the request path,
published in batches per pool by one task); decision batches carry heartbeats, record batches
do not (no picker reads them back).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import msgspec
from nats.aio.client import Client
from nats.aio.subscription import Subscription

from scheduling.record import Record, RecordBatch
from services.picker.batch_sender import MAX_PENDING, BatchQueue, BatchSender
from services.picker.feeds import subscribe_each
from shared.logs import RateLimitedLog
from shared.schemas import DecisionBatch, DecisionEvent, DecodeError, decode, encode
from shared.subjects import Subjects

log = logging.getLogger("lig.picker.decision_stream")

MAX_PENDING_RECORDS = 10_000  # records waiting to be published, over every pool


def decision_queue(sender: BatchSender, subjects: Subjects, *, max_pending: int = MAX_PENDING,
                   on_published: Callable[[int], None] = lambda count: None,
                   on_dropped: Callable[[str, int], None] = lambda reason, count: None
                   ) -> BatchQueue[DecisionEvent]:
    """The decision stream's queue on ``sender``: ``DecisionBatch`` messages with heartbeats
    (the gateway's ``on_decision`` callback)."""
    picker, heartbeat = sender.picker_id, sender.heartbeat

    def wrap(pool: str, sent_at_ns: int, events: list[DecisionEvent]) -> bytes:
        return encode(DecisionBatch(picker, pool, sent_at_ns, events, heartbeat))

    return sender.queue(subjects.decisions, wrap, heartbeat=True, max_pending=max_pending,
                        on_published=on_published, on_dropped=on_dropped)


def record_queue(sender: BatchSender, subjects: Subjects, *,
                 max_pending: int = MAX_PENDING_RECORDS,
                 on_published: Callable[[int], None] = lambda count: None,
                 on_dropped: Callable[[str, int], None] = lambda reason, count: None
                 ) -> BatchQueue[Record]:
    """The flight recorder's queue on ``sender``: ``RecordBatch`` messages (the gateway's
    ``on_record`` callback)."""
    picker = sender.picker_id

    def wrap(pool: str, sent_at_ns: int, records: list[Record]) -> bytes:
        return encode(RecordBatch(picker, pool, sent_at_ns, records))

    return sender.queue(subjects.records, wrap, max_pending=max_pending,
                        on_published=on_published, on_dropped=on_dropped)


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


class Publishing(msgspec.Struct):
    """What a picker publishes, through one sender: its decisions for peers (None: not shared)
    and its decision records (None: not recording)."""

    sender: BatchSender
    decisions: BatchQueue[DecisionEvent] | None
    records: BatchQueue[Record] | None

    @property
    def picker_id(self) -> str:
        """This picker's id in both streams."""
        return self.sender.picker_id
