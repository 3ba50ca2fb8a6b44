"""Publishing snapshots with core NATS: fire and forget, dropped (and counted) while offline.

Snapshots are only useful fresh, so while NATS is unreachable they are dropped rather than
buffered: a burst of stale snapshots after a reconnect would only mislead pickers.
"""

from __future__ import annotations

import logging

from nats.aio.client import Client

from services.collector.observability import CollectorMetrics
from shared.logs import RateLimitedLog
from shared.schemas import PodMetrics, encode

log = logging.getLogger("lig.collector.publisher")


class SnapshotPublisher:
    """Publishes each snapshot to its pod's subject."""

    def __init__(self, nc: Client, metrics: CollectorMetrics) -> None:
        self._nc = nc
        self._published = metrics.published
        self._dropped = metrics.publish_errors.labels("disconnected")
        self._failed = metrics.publish_errors.labels("error")
        self._failure_log = RateLimitedLog(log)

    async def publish(self, subject: str, snapshot: PodMetrics) -> None:
        """Publish, or count the snapshot as dropped; never raises."""
        if not self._nc.is_connected:
            self._dropped.inc()
            return
        try:
            await self._nc.publish(subject, encode(snapshot))
        except Exception as exc:  # any failure is one lost snapshot, never a dead pod loop
            self._failed.inc()
            self._failure_log.warning("publishing to %s failed: %s", subject, exc)
        else:
            self._published.inc()
