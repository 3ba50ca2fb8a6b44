"""Running a long-lived asyncio service: uvloop, and a clean stop on SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is absent only on platforms we do not ship for
    uvloop = None


def run_service(main: Callable[[asyncio.Event], Awaitable[int | None]]) -> int:
    """Run ``main(stop)`` on uvloop; SIGTERM/SIGINT set ``stop``, which ``main`` must honour.

    Returns ``main``'s exit code (0 when it returns None).
    """

    async def runner() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        return await main(stop) or 0

    if uvloop is not None:
        return uvloop.run(runner())
    return asyncio.run(runner())
