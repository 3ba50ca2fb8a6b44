"""Metric snapshots from NATS into the pod tables: ``<prefix>.metrics.<pool>.>`` for each served
pool (``<prefix>.metrics.>`` when serving every pool), newest per pod.

nats-py re-subscribes by itself after a reconnect, so this subscription needs no resync.
Undecodable payloads (wrong schema version, garbage, a snapshot of a pool not served) are
counted and skipped, never raised; so are snapshots whose address is not the registered
endpoint's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from nats.aio.client import Client
from nats.aio.subscription import Subscription

from services.picker.feeds import subscribe_each
from services.picker.state import PodTable
from shared.logs import RateLimitedLog
from shared.schemas import DecodeError, PodMetrics, decode
from shared.subjects import Subjects

log = logging.getLogger("lig.picker.metrics_feed")


class SnapshotSink:
    """Decodes one snapshot payload into its pool's table; the part of the feed without a
    network. ``table_of(pool)`` is that table, or None for a pool not served."""

    def __init__(self, table_of: Callable[[str], PodTable | None],
                 on_undecodable: Callable[[], None] = lambda: None,
                 on_out_of_order: Callable[[], None] = lambda: None,
                 on_wrong_address: Callable[[], None] = lambda: None,
                 on_received: Callable[[], None] = lambda: None) -> None:
        self.table_of = table_of
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
        table = self.table_of(snapshot.pool)
        if table is None:
            self._skip(subject, f"snapshot of pool {snapshot.pool!r}, not served")
            return
        if not table.address_matches(snapshot):
            self._on_wrong_address()
            self._wrong_address.warning(
                "dropping snapshot on %s: pod %r is registered at another address than %r",
                subject, snapshot.pod, snapshot.address)
            return
        if not table.apply(snapshot):
            self._on_out_of_order()

    def _skip(self, subject: str, reason: str) -> None:
        self._on_undecodable()
        self._bad.warning("skipping metrics message on %s: %s", subject, reason)


async def subscribe(client: Client, subjects: Subjects, sink: SnapshotSink,
                    pools: Sequence[str]) -> list[Subscription]:
    """Feed every snapshot of ``pools`` (empty: of every pool) published on NATS into
    ``sink``."""

    names = [subjects.pool_metrics(pool) for pool in pools] or [subjects.all_metrics()]
    return await subscribe_each(client, names, sink.accept)
