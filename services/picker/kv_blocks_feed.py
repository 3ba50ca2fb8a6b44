"""The pods' KV block-set changes from NATS into the pools' precise indexes:
``<prefix>.kvblocks.<pool>.>`` for each served pool (``<prefix>.kvblocks.>`` when serving every
pool), one :class:`~shared.kv_blocks.KVBlockChanges` per message, published by ``lig kv-events``.

With ``history``, and when ``lig kv-events`` records them (JetStream stream ``<PREFIX>_KVBLOCKS``),
the feed reads the recording from its start and then goes on live, through one ordered consumer
per subject: vLLM announces a block once, when it enters the cache, so a picker started after the
pods would otherwise never learn the blocks they already hold (a hot system prompt, say). Without
the recording (or the right to read it) it subscribes to the live messages only, and says so.

Messages that do not decode (garbage, another schema version), of a pool not served, about a
pod the registry lists at another address, or (once the registry named the pool's members) about
a pod it does not list are counted and skipped (logged, rate-limited), never raised. Changes
that arrive before the registry is read (a recording replayed at start-up) are applied; the
router then drops the pods that are not members. Nothing is checked against the subject: the
payload names its pool and pod.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError

from scheduling.precise_index import PreciseIndex
from services.picker.feeds import PENDING_MESSAGES, subscribe_each
from services.picker.state import PodTable
from shared.kv_blocks import decode
from shared.logs import RateLimitedLog
from shared.subjects import Subjects

log = logging.getLogger("lig.picker.kv_blocks_feed")

ORDERED_HEARTBEAT_S = 0.5
"""The recording's consumers' idle heartbeat. nats-py rebuilds an ordered consumer once two
heartbeats are missed; with its default (5 s) a consumer lost with a restarted NATS came back
10-20 s later (12 s measured, bench/bench_kv_events_nats_restart.py), against 0.5 s for live
subscriptions; with 0.5 s, about 1 s. A rebuild resumes after the last message delivered: a
spurious one (a loaded picker) costs a request, never a message."""


class KVBlocksSink:
    """Decodes one message into its pool's precise index; the part of the feed without a
    network. ``index_of(pool)`` is the pool's (index, pod table), or None for a pool not served
    (or whose precise index is off). ``on_skip(reason)`` counts a message skipped: ``undecodable``,
    ``pool`` (not served), ``address`` (the pod is registered elsewhere) or ``unknown`` (the
    pod is not a member)."""

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
        if registered is None and pods.members_known:
            # Not a member: a pod gone (its last events in flight) or a forged name. Applied,
            # it would stay in the index (only members leaving are forgotten), take blocks from
            # the members at the bound, and cost every lookup a pass over it.
            self._skip("unknown", subject, f"pod {changes.pod!r} is not a member of the pool")
            return
        if registered is not None and registered != changes.address:
            self._skip("address", subject, f"pod {changes.pod!r} is registered at "
                       f"{registered}, not {changes.address}")
            return
        index.apply(changes)

    def _skip(self, reason: str, subject: str, detail: str) -> None:
        self._on_skip(reason)
        self._log.warning("skipping KV block changes on %s (%s): %s", subject, reason, detail)


async def subscribe(client: Client, subjects: Subjects, sink: KVBlocksSink,
                    pools: Sequence[str], history: bool = False) -> list[Subscription]:
    """Feed the KV block-set changes of ``pools`` (empty: of every pool) into ``sink``; with
    ``history``, those recorded before too (see the module's docstring)."""

    names = [subjects.pool_kv_blocks(pool) for pool in pools] or [subjects.all_kv_blocks()]
    if history:
        recorded = await _subscribe_recorded(client, subjects.kv_blocks_stream, names, sink)
        if recorded is not None:
            return recorded
    return await subscribe_each(client, names, sink.accept)


async def _subscribe_recorded(client: Client, stream: str, names: Sequence[str],
                              sink: KVBlocksSink) -> list[Subscription] | None:
    """Ordered consumers over ``stream`` from its first message, one per subject; None (logged)
    when the stream cannot be read."""
    js = client.jetstream()
    try:
        await js.stream_info(stream)
    except NotFoundError:
        log.info("no recording of KV block changes (%s): the precise index learns from the "
                 "live changes only", stream)
        return None
    except (NatsError, TimeoutError) as exc:
        log.warning("cannot read the recording of KV block changes %s (%s: %s): the precise "
                    "index learns from the live changes only", stream, type(exc).__name__, exc)
        return None

    async def on_message(message: Msg) -> None:
        sink.accept(message.subject, message.data)

    subscriptions: list[Subscription] = []
    try:
        for name in names:
            subscriptions.append(await js.subscribe(
                name, stream=stream, cb=on_message, ordered_consumer=True,
                idle_heartbeat=ORDERED_HEARTBEAT_S,
                deliver_policy=DeliverPolicy.ALL, pending_msgs_limit=PENDING_MESSAGES))
    except (NatsError, TimeoutError) as exc:
        log.warning("cannot read the recording of KV block changes %s (%s: %s): the precise "
                    "index learns from the live changes only", stream, type(exc).__name__, exc)
        for subscription in subscriptions:
            with contextlib.suppress(NatsError, TimeoutError):
                await subscription.unsubscribe()
        return None
    log.info("KV block changes: reading %s from its start, then live", stream)
    return subscriptions
