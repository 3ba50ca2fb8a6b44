"""Polling for a condition instead of sleeping a fixed time (the machine is shared and noisy)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(condition: Callable[[], bool], within: float = 5.0, what: str = "") -> None:
    """Wait until ``condition()`` is true, polling; fail the test after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {within}s: {what or condition}")
        await asyncio.sleep(0.02)


def wait_until(condition: Callable[[], bool], within: float = 5.0, what: str = "") -> None:
    """Blocking form of :func:`eventually` for synchronous tests."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {within}s: {what or condition}")
        time.sleep(0.02)
