"""Measuring a registry burst reaching a picker (tests/test_picker_registry_burst.py and
bench/bench_registry_apply.py): the router's update cost and the event loop's longest stall."""

from __future__ import annotations

import asyncio
import time

from services.picker.routing import Router


class TimedRouter(Router):
    """The picker's router, counting the CPU time and the number of its registry updates."""

    busy = 0.0
    updates = 0

    def update(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        """:meth:`Router.update`, timed and counted."""
        start = time.process_time()
        super().update(*args, **kwargs)
        self.busy += time.process_time() - start
        self.updates += 1


class LoopStall:
    """While entered: the most CPU time the event loop's thread spent before coming back to a
    task sleeping 2 ms, i.e. how long the loop was busy elsewhere (CPU, not wall time, so that
    other processes on a shared machine do not count)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            before = time.thread_time()
            await asyncio.sleep(0.002)
            self.worst = max(self.worst, time.thread_time() - before)

    def __enter__(self) -> LoopStall:
        self._task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()
