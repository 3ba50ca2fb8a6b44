"""The pods' KV block-set changes from NATS into the pools' precise indexes:
``<prefix>.kvblocks.<pool>.>`` for each served pool (``<prefix>.kvblocks.>`` when serving every
pool), one :class:`~shared.kv_blocks.KVBlockChanges` per message, published by ``lig kv-events``.

Messages that do not decode (garbage, another schema version), of a pool not served, or about a
pod the registry lists at another address are counted and skipped (logged, rate-limited), never
raised. Nothing is checked against the subject: the payload names its pool and pod.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from scheduling.precise_index import PreciseIndex
from services.picker.state import PodTable
from shared.kv_blocks import decode
from shared.logs import RateLimitedLog
from shared.subjects import Subjects

log = logging.getLogger("lig.picker.kv_blocks_feed")


class KVBlocksSink:
    """Decodes one message into its pool's precise index; the part of the feed without a
    network. ``index_of(pool)`` is the pool's (index, pod table), or None for a pool not served
    (or whose precise index is off). ``on_skip(reason)`` counts a message skipped: ``undecodable``,
    ``pool`` (not served) or ``address`` (the pod is registered elsewhere)."""

    def __init__(self, index_of: Callable[[str], tuple[PreciseIndex, PodTable] | None],
                 on_skip: Callable[[str], None] = lambda reason: None) -> None:
        self.index_of = index_of
        self._on_skip = on_skip
        self._log = RateLimitedLog(log)

    def accept(self, subject: str, data: bytes) -> None:
        """Apply one payload received on ``subject``; count and skip it when it is bad."""
        try:
            changes = decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._skip("undecodable", subject, str(exc))
            return
        found = self.index_of(changes.pool)
        if found is None:
            self._skip("pool", subject, f"changes of pool {changes.pool!r}, not served")
            return
        index, pods = found
        registered = pods.registered_address(changes.pod)
        if registered is not None and registered != changes.address:
            self._skip("address", subject, f"pod {changes.pod!r} is registered at "
                       f"{registered}, not {changes.address}")
            return
        index.apply(changes)

    def _skip(self, reason: str, subject: str, detail: str) -> None:
        self._on_skip(reason)
        self._log.warning("skipping KV block changes on %s (%s): %s", subject, reason, detail)


async def subscribe(client: Client, subjects: Subjects, sink: KVBlocksSink,
                    pools: Sequence[str]) -> list[Subscription]:
    """Feed the KV block-set changes of ``pools`` (empty: of every pool) into ``sink``."""

    async def on_message(message: Msg) -> None:
        sink.accept(message.subject, message.data)

    names = [subjects.pool_kv_blocks(pool) for pool in pools] or [subjects.all_kv_blocks()]
    return [await client.subscribe(name, cb=on_message, pending_msgs_limit=100_000)
            for name in names]
