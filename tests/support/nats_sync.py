"""A barrier a test can trust: everything a NATS client queued has reached the server.

nats-py's ``flush()`` writes its PING straight to the socket, while ``subscribe()`` and
``publish()`` only queue their SUB and PUB for the client's background flusher. So the PING can
reach the server first, and ``flush()`` returns while the server has not seen the SUB: a message
published in that gap is dropped by core NATS, and a "nothing arrived" check passes without
testing anything (docs/nats-py-flush.md has the trace and the numbers).

The first ``flush()`` wakes the flusher, which writes the queued commands before that PING's PONG
can be read (it runs before the next poll of the socket); the second PING is written after them,
so its PONG means the server has processed them. Repeating subscribe, barrier, publish: one
``flush()`` lost 60 of 2,000 messages here, :func:`synced` 0 of 2,000.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription


async def synced(client: Client) -> None:
    """Return once the server has processed every command ``client`` queued so far."""
    await client.flush()
    await client.flush()


async def subscribed(client: Client, subject: str,
                     cb: Callable[[Msg], Awaitable[None]] | None = None) -> Subscription:
    """``client.subscribe(subject, cb=cb)``, returned once the server has the subscription."""
    subscription = await client.subscribe(subject, cb=cb)
    await synced(client)
    return subscription
