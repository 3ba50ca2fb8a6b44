"""A service's resources, released in reverse order of acquisition, each within a bound.

:class:`Lifespan` is an ``AsyncExitStack``: what a service opens first (its metrics server, say)
is closed last, whether ``serve`` returns or fails halfway through starting. Every release is
bounded (:func:`shared.service.finish_within`, :func:`shared.service.cancel_and_wait`), so a
stop never hangs on a peer that does not answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from shared.host.metrics_http import MetricsServer
from shared.service import cancel_and_wait, finish_within

T = TypeVar("T")


class Lifespan:
    """``async with Lifespan() as life:`` opens resources through ``life``; leaving the block
    releases them, newest first."""

    def __init__(self) -> None:
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Lifespan:
        await self._stack.__aenter__()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> bool:
        return bool(await self._stack.__aexit__(kind, error, trace))

    def on_close(self, close: Callable[[], Awaitable[Any]], within: float) -> None:
        """Run ``close()`` on the way out, for at most ``within`` seconds (errors dropped)."""
        self._stack.push_async_callback(lambda: finish_within(close(), within))

    async def enter(self, manager: contextlib.AbstractAsyncContextManager[T]) -> T:
        """Enter an async context manager now, leave it on the way out."""
        return await self._stack.enter_async_context(manager)

    def callback(self, close: Callable[[], object]) -> None:
        """Call ``close()`` (synchronous, quick) on the way out."""
        self._stack.callback(close)

    def task(self, work: Coroutine[Any, Any, T], *, finish: float = 0.0,
             grace: float = 1.5) -> asyncio.Task[T]:
        """Run ``work`` as a task. On the way out it gets ``finish`` seconds to end by itself
        (a task that watches the service's stop event and says goodbye, say), then is
        cancelled and awaited up to ``grace`` seconds."""
        task = asyncio.create_task(work)
        self._stack.push_async_callback(_end, task, finish, grace)
        return task

    def metrics_server(self, host: str, port: int,
                       registry: CollectorRegistry) -> MetricsServer | None:
        """Serve ``registry`` on ``http://host:port/metrics`` (None when ``port`` is 0).

        Raises :class:`~shared.host.errors.PortInUse` when the port cannot be bound."""
        if not port:
            return None
        server = MetricsServer.start(host, port, registry)
        self.on_close(lambda: asyncio.to_thread(server.stop), within=2.0)
        return server


async def _end(task: asyncio.Task[Any], finish: float, grace: float) -> None:
    if finish > 0:
        await asyncio.wait({task}, timeout=finish)
    await cancel_and_wait(task, grace)
    if task.done() and not task.cancelled():
        task.exception()  # retrieved: the service logs what matters before it stops
