"""Waiting with a time limit without losing a cancellation.

On Python 3.11, ``asyncio.wait_for`` swallows a cancellation that arrives in the loop iteration
in which the awaited future completes (CPython gh-86296; 3.12 rebuilt ``wait_for`` on
``asyncio.timeout``): the cancelled task carries on as if nothing had happened. A service loop
cancelled at shutdown then never ends; the registry's stop hung that way under load
(``tests/test_waits.py`` reproduces it). ``asyncio.timeout`` has no such race, so the project
waits with these two, and a test keeps ``asyncio.wait_for`` out of its code.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], seconds: float | None) -> T:
    """``await awaitable``; TimeoutError (and the awaitable cancelled) after ``seconds``
    (None: no limit)."""
    async with asyncio.timeout(seconds):
        return await awaitable


async def wait_set(event: asyncio.Event, seconds: float | None) -> bool:
    """Wait until ``event`` is set, at most ``seconds`` (None: no limit); whether it is set."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()
    return event.is_set()
