"""Shutdown helpers: a service stops on time even when a step ignores cancellation (no network)."""

from __future__ import annotations

import asyncio

from shared.service import cancel_and_wait, finish_within


async def _stubborn(cancels_ignored: int, log: list[str]) -> None:
    """Sleeps, and ignores the first ``cancels_ignored`` cancellations (as ``asyncio.wait_for``
    inside nats-py can on Python 3.11)."""
    ignored = 0
    while True:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            if ignored == cancels_ignored:
                log.append("cancelled")
                raise
            ignored += 1


async def test_cancel_and_wait_cancels_again_until_the_task_ends() -> None:
    log: list[str] = []
    task = asyncio.create_task(_stubborn(2, log))
    await asyncio.sleep(0)
    await cancel_and_wait(task, grace=3.0)
    assert task.cancelled() and log == ["cancelled"]


async def test_finish_within_returns_on_time_and_drops_errors() -> None:
    loop = asyncio.get_running_loop()
    log: list[str] = []
    started = loop.time()
    await finish_within(_stubborn(1, log), 0.1)
    assert loop.time() - started < 1.5 and log == ["cancelled"]

    async def failing() -> None:
        raise ConnectionError("NATS is away")

    await finish_within(failing(), 1.0)  # no exception escapes, nothing logged as unretrieved

    async def quick() -> str:
        return "closed"

    started = loop.time()
    await finish_within(quick(), 5.0)
    assert loop.time() - started < 0.5
