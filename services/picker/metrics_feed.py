"""Metric snapshots from NATS into the pod table: ``<prefix>.metrics.<pool>.>``, newest per pod.

nats-py re-subscribes by itself after a reconnect, so this subscription needs no resync.
Undecodable payloads (wrong schema version, garbage, another pool's snapshot) are counted and
skipped, never raised; so are snapshots whose address is not the registered endpoint's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.picker.state import PodTable
from shared.logs import RateLimitedLog
from shared.schemas import DecodeError, PodMetrics, decode
from shared.subjects import Subjects

log = logging.getLogger("lig.picker.metrics_feed")


class SnapshotSink:
    """Decodes one snapshot payload into the table; the part of the feed without a network."""

    def __init__(self, pool: str, table: PodTable,
                 on_undecodable: Callable[[], None] = lambda: None,
                 on_out_of_order: Callable[[], None] = lambda: None,
                 on_wrong_address: Callable[[], None] = lambda: None,
                 on_received: Callable[[], None] = lambda: None) -> None:
        self.pool = pool
        self.table = table
        self._on_undecodable = on_undecodable
        self._on_out_of_order = on_out_of_order
        self._on_wrong_address = on_wrong_address
        self._on_received = on_received
        self._wrong_address = RateLimitedLog(log)
        self._bad = RateLimitedLog(log)

    def accept(self, subject: str, data: bytes) -> None:
        """Apply one payload received on ``subject``; count and skip it when it is bad."""
        self._on_received()
        try:
            snapshot = decode(data, PodMetrics)
        except DecodeError as exc:
            self._skip(subject, str(exc))
            return
        if snapshot.pool != self.pool:
            self._skip(subject, f"snapshot of pool {snapshot.pool!r}")
            return
        if not self.table.address_matches(snapshot):
            self._on_wrong_address()
            self._wrong_address.warning(
                "dropping snapshot on %s: pod %r is registered at another address than %r",
                subject, snapshot.pod, snapshot.address)
            return
        if not self.table.apply(snapshot):
            self._on_out_of_order()

    def _skip(self, subject: str, reason: str) -> None:
        self._on_undecodable()
        self._bad.warning("skipping metrics message on %s: %s", subject, reason)


async def subscribe(client: Client, subjects: Subjects, sink: SnapshotSink) -> Subscription:
    """Feed every snapshot of ``sink.pool`` published on NATS into ``sink``."""

    async def on_message(message: Msg) -> None:
        sink.accept(message.subject, message.data)

    return await client.subscribe(subjects.pool_metrics(sink.pool), cb=on_message,
                                  pending_msgs_limit=100_000)
