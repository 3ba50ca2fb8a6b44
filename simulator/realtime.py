"""Run one simulated engine in real time on asyncio, optionally faster than the wall clock.

API::

    clock = PacedClock(time_scale=10.0)          # 10 simulated seconds per wall second
    runner = EngineRunner(engine, clock, on_step=metrics.record_step)
    task = asyncio.create_task(runner.run())
    request = runner.submit(spec)                # RequestRejected if the engine refuses it
    request.watcher = event.set                  # called after each token and at the end
    runner.abort(request)

Step boundaries are nominal: a step that begins at simulated time ``s`` and lasts ``d`` ends at
exactly ``s + d`` even when the event loop wakes a little late, and the next step begins there.
Arrivals are stamped with the wall clock (scaled), held inside the window of the step in flight,
and an arrival that wakes an idle engine begins the next step at its own timestamp. Replaying the
stamped arrivals through ``virtual_time.VirtualFleet`` with the same seed therefore gives the same
token timeline. When the host is too slow to keep up, simulated time simply runs behind.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from simulator.engine import Engine, Request, RequestSpec, StepResult


class PacedClock:
    """Simulated seconds = wall seconds since start x ``time_scale``, clamped by the driver."""

    def __init__(self, time_scale: float = 1.0, wall: Callable[[], float] = time.monotonic):
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.time_scale = time_scale
        self._wall = wall
        self._origin = wall()
        self._floor = 0.0
        self._ceiling = math.inf

    def scaled_wall(self) -> float:
        """Unclamped simulated time from the wall clock."""
        return (self._wall() - self._origin) * self.time_scale

    def now(self) -> float:
        """The scaled wall time, held within the driver's current window."""
        return min(max(self.scaled_wall(), self._floor), self._ceiling)

    def hold(self, floor: float, ceiling: float = math.inf) -> None:
        """Keep ``now()`` within ``[floor, ceiling]`` until the next call."""
        self._floor = floor
        self._ceiling = ceiling

    def wall_delay(self, until: float) -> float:
        """Wall seconds until simulated time ``until`` (0 if already past)."""
        return max(0.0, (until - self.scaled_wall()) / self.time_scale)


class EngineRunner:
    """Drives one ``Engine`` step by step, sleeping out each step's duration."""

    def __init__(
        self,
        engine: Engine,
        clock: PacedClock,
        on_step: Callable[[StepResult], None] | None = None,
    ) -> None:
        if engine.clock is not clock:
            raise ValueError("the engine must read the runner's clock")
        self.engine = engine
        self.clock = clock
        self._on_step = on_step
        self._wake = asyncio.Event()
        self._idle = True

    def submit(self, spec: RequestSpec) -> Request:
        """Queue a request now; raises ``RequestRejected`` when the engine refuses it."""
        self.engine.validate(spec)
        if self._idle:
            # The arrival wakes the engine: its step begins at the arrival's own time.
            arrived = self.clock.now()
            self.clock.hold(arrived, arrived)
            self._idle = False
            self._wake.set()
        return self.engine.submit(spec)

    def abort(self, request: Request) -> None:
        """Stop working on ``request`` (its client went away)."""
        self.engine.abort(request)

    async def run(self) -> None:
        """Step while there is work; wait for a submission when there is none. Runs until
        cancelled."""
        engine = self.engine
        clock = self.clock
        while True:
            plan = engine.begin_step()
            if plan is None:
                clock.hold(clock.now())
                self._idle = True
                self._wake.clear()
                await self._wake.wait()
                continue
            clock.hold(plan.start, plan.end)
            await asyncio.sleep(clock.wall_delay(plan.end))
            clock.hold(plan.end, plan.end)
            result = engine.finish_step()
            for request in result.emitted:
                if request.watcher is not None:
                    request.watcher()
            for request in result.finished:
                if request.watcher is not None and request.finish_reason == "abort":
                    request.watcher()
            if self._on_step is not None:
                self._on_step(result)
