"""Shutdown helpers: a service stops on time even when a step ignores cancellation (no network)."""

from __future__ import annotations

import asyncio
import math

from shared.service import cancel_and_wait, finish_within


async def _stubborn(cancels_ignored: float, log: list[str],
                    released: asyncio.Event | None = None) -> None:
    """Sleeps (until ``released``, if given), and ignores the first ``cancels_ignored``
    cancellations (as ``asyncio.wait_for`` inside nats-py can on Python 3.11)."""
    ignored = 0
    while released is None or not released.is_set():
        try:
            await asyncio.sleep(60 if released is None else 0.05)
        except asyncio.CancelledError:
            if ignored == cancels_ignored:
                log.append("cancelled")
                raise
            ignored += 1


async def test_cancel_and_wait_cancels_again_until_the_task_ends() -> None:
    log: list[str] = []
    task = asyncio.create_task(_stubborn(2, log))
    await asyncio.sleep(0)
    # Cancelled at once, then every 0.5 s: the third cancellation is due at 1 s, and the grace
    # leaves a loaded machine's late timers 9 s more (it ends when the task does).
    await cancel_and_wait(task, grace=10.0)
    assert task.cancelled() and log == ["cancelled"]


async def test_finish_within_returns_on_time_and_drops_errors() -> None:
    loop = asyncio.get_running_loop()
    log: list[str] = []
    # A step that takes cancellation is cancelled once its time is up.
    await finish_within(_stubborn(0, log), 0.1)
    assert log == ["cancelled"]

    # One that swallows every cancellation (cancelled again within a 1 s grace) does not hold
    # the stop: it returns after 0.1 s + 1 s, not after the step's 60 s; the 2 s more are a
    # loaded machine's late timers. (Cancelling again is shown above, with a longer grace.)
    released = asyncio.Event()
    started = loop.time()
    await finish_within(_stubborn(math.inf, log, released), 0.1)
    assert loop.time() - started < 0.1 + 1.0 + 2.0 and log == ["cancelled"]
    released.set()

    async def failing() -> None:
        raise ConnectionError("NATS is away")

    await finish_within(failing(), 1.0)  # no exception escapes, nothing logged as unretrieved

    async def quick() -> str:
        return "closed"

    # Returns when the step does, not when its time is up (60 s, far from any lateness).
    started = loop.time()
    await finish_within(quick(), 60.0)
    assert loop.time() - started < 30.0
