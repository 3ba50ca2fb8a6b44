"""Waiting with a time limit never loses a cancellation (shared/waits.py).

The race: the awaited event is set and the waiting task cancelled in the same loop iteration.
``asyncio.wait_for`` on Python 3.11 returns normally then (CPython gh-86296), so a loop that
waits again runs on after its cancellation: ``Reconciler.run`` did, and the registry's stop hung
(1 run in 16 of its test on a loaded machine; a task dump showed the run loop "cancelling" and
waiting on a fresh ``wait_for``). The same loop around :func:`wait_set` ends.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from shared.waits import wait_set, within

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("lig", "shared", "services", "scheduling", "simulator", "recording",
            "scheduling_bench", "resilience", "envoy_bootstrap")


async def _forever(wake: asyncio.Event) -> None:
    """A service loop: wait for a wake-up or a short timeout, then wait again."""
    while True:
        await wait_set(wake, 0.05)
        wake.clear()


async def test_a_cancellation_in_the_iteration_that_sets_the_event_ends_the_loop() -> None:
    for _ in range(20):
        wake = asyncio.Event()
        task = asyncio.create_task(_forever(wake))
        await asyncio.sleep(0.01)
        wake.set()
        task.cancel()  # the same iteration: the event's waiter and the cancel race
        with pytest.raises(asyncio.CancelledError):
            await within(asyncio.shield(task), 2.0)


async def test_a_cancellation_when_the_time_runs_out_ends_the_loop() -> None:
    wake = asyncio.Event()
    task = asyncio.create_task(_forever(wake))
    await asyncio.sleep(0.05)  # on the edge of a timeout; either way it must end
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await within(asyncio.shield(task), 2.0)


async def test_wait_set_says_whether_the_event_came_and_within_raises_on_time() -> None:
    event = asyncio.Event()
    assert await wait_set(event, 0.01) is False
    asyncio.get_running_loop().call_soon(event.set)
    assert await wait_set(event, 5.0) is True
    assert await within(asyncio.sleep(0, "done"), 1.0) == "done"
    with pytest.raises(TimeoutError):
        await within(asyncio.Event().wait(), 0.01)


def test_the_code_waits_without_asyncio_wait_for() -> None:
    """``asyncio.wait_for`` stays out of the packages (shared/waits.py says why)."""
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if re.search(r"\basyncio\.wait_for\(|^\s*from asyncio import .*\bwait_for\b",
                             code):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert found == [], "use shared.waits.within / wait_set:\n" + "\n".join(found)

