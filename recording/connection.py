"""Connecting ``lig record`` and ``lig replay`` to NATS: like the services (same flags and
credentials), but giving up after a while instead of retrying forever."""

from __future__ import annotations

from nats.aio.client import Client

from shared.nats_connection import NatsSettings, connect
from shared.waits import within

CONNECT_TIMEOUT_S = 10.0


async def connect_within(settings: NatsSettings, name: str,
                         seconds: float = CONNECT_TIMEOUT_S) -> Client:
    """A connection to ``settings.url``; ConnectionError naming the URL after ``seconds``."""
    try:
        return await within(connect(settings, name), seconds)
    except TimeoutError:
        raise ConnectionError(f"cannot connect to NATS at {settings.url} within {seconds:g} s"
                              ) from None
