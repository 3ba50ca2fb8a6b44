"""What the picker's NATS feeds (snapshots, decisions, KV block changes) share: one plain
subscription per subject, every message handed to a sink's ``accept(subject, data)``.

nats-py re-subscribes by itself after a reconnect, so these subscriptions need no resync.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

PENDING_MESSAGES = 100_000  # per subscription, before nats-py drops messages (slow consumer)


async def subscribe_each(client: Client, names: Sequence[str],
                         accept: Callable[[str, bytes], None]) -> list[Subscription]:
    """Subscribe to each subject of ``names``; ``accept(subject, data)`` gets every message."""

    async def on_message(message: Msg) -> None:
        accept(message.subject, message.data)

    return [await client.subscribe(name, cb=on_message, pending_msgs_limit=PENDING_MESSAGES)
            for name in names]
