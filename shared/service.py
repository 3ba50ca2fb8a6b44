"""Running a long-lived asyncio service: uvloop, and a clean stop on SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import uvloop


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

    return uvloop.run(runner())


async def cancel_and_wait(task: asyncio.Task[Any], grace: float = 1.5) -> None:
    """Cancel ``task`` and wait up to ``grace`` seconds for it to end, cancelling it again
    every 0.5 s: on Python 3.11 ``asyncio.wait_for`` (which nats-py uses while connecting) can
    swallow a cancellation (:mod:`shared.waits`), and a service must still stop."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    while not task.done():
        remaining = deadline - loop.time()
        if remaining <= 0:
            return
        task.cancel()
        await asyncio.wait({task}, timeout=min(0.5, remaining))


async def finish_within(step: Awaitable[Any], seconds: float) -> None:
    """Give a best-effort shutdown step (closing a NATS connection, say) ``seconds`` to finish,
    then cancel it as :func:`cancel_and_wait` does; its errors are dropped. Unlike
    ``asyncio.wait_for``, this returns on time even if the step swallows a cancellation."""
    task = asyncio.ensure_future(step)
    await asyncio.wait({task}, timeout=seconds)
    if not task.done():
        await cancel_and_wait(task, grace=1.0)
    if task.done() and not task.cancelled():
        task.exception()  # retrieved: a failed close is expected while NATS is away
