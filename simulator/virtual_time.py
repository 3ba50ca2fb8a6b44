"""Run simulated engines in virtual time: a discrete-event driver that never sleeps.

API::

    fleet = VirtualFleet([EngineConfig(...)] * 8, seed=1)
    run = fleet.run(arrivals, router=my_router)   # arrivals: Arrival(time, spec, pod=None)
    run.requests        # RequestResult per arrival, in arrival order: TTFT, ITL, E2E, ...
    run.pods            # EngineCounters per pod: preemptions, adapter loads, prefix-cache hits
    run.totals()        # the same summed over pods
    fleet.engines[i].snapshot()   # EngineSnapshot: what a picker would see

Routing: an arrival with ``pod`` set goes there; otherwise ``router(arrival, snapshots)`` returns
a pod index, where ``snapshots`` are the pods' ``EngineSnapshot``s, refreshed at most every
``snapshot_interval`` virtual seconds (0 = exact state at the arrival, like a picker with
perfectly fresh metrics; 0.05 = a 50 ms scrape interval). Without a router: round-robin.

At each instant the driver first ends the steps that end then, then submits the arrivals of that
instant, then begins a step on every idle pod with work. The real-time driver keeps the same
order, so the same arrivals and seed give the same token timeline in both.

The loop itself is :class:`EventLoop`: engine steps plus any timed events on one clock.
``VirtualFleet`` puts its arrivals on it; ``lig bench`` (``scheduling_bench/fleet.py``) puts its
arrivals, scrapes, snapshot deliveries and picker replicas' shared decisions on the same loop.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from simulator.engine import (
    Engine,
    EngineConfig,
    EngineCounters,
    EngineSnapshot,
    Request,
    RequestRejected,
    RequestSpec,
    StepResult,
)


def engine_rng(seed: int, pod: int) -> random.Random:
    """The RNG of pod ``pod`` in a run seeded ``seed`` (shared by both drivers)."""
    return random.Random(seed * 1_000_003 + pod)


class VirtualClock:
    """Simulated time that moves only when the driver says so."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        """The current simulated time, seconds."""
        return self._now

    def advance_to(self, when: float) -> None:
        """Move to ``when``; time never goes back."""
        if when < self._now:
            raise ValueError(f"virtual time cannot go back from {self._now} to {when}")
        self._now = when


class Arrival(msgspec.Struct, frozen=True):
    """A request arriving at a virtual time, optionally pinned to a pod."""

    time: float
    spec: RequestSpec
    pod: int | None = None


Router = Callable[[Arrival, Sequence[EngineSnapshot]], int]
StepObserver = Callable[[int, StepResult], None]


class RequestResult(msgspec.Struct, frozen=True):
    """How one request went. Times are virtual seconds; latencies are None when not reached."""

    request_id: str
    pod: int
    arrival_time: float
    rejected: str | None = None
    """Why the pod refused the request (then nothing else is set)."""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    queue_time: float | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl_mean: float | None = None
    itl_max: float | None = None
    token_times: tuple[float, ...] | None = None
    """Every token's time, when the engine config has ``record_token_times``."""


class RunResult(msgspec.Struct, frozen=True):
    """A whole virtual run."""

    requests: tuple[RequestResult, ...]
    pods: tuple[EngineCounters, ...]
    end_time: float
    """Virtual time when the last step ended."""
    wall_seconds: float

    def totals(self) -> EngineCounters:
        """Counters summed over pods."""
        total = EngineCounters()
        for counters in self.pods:
            for field in EngineCounters.__struct_fields__:
                setattr(total, field, getattr(total, field) + getattr(counters, field))
        return total


class VirtualFleet:
    """N engines on one virtual clock."""

    def __init__(self, configs: Sequence[EngineConfig], seed: int = 0) -> None:
        if not configs:
            raise ValueError("a fleet needs at least one engine config")
        self.clock = VirtualClock()
        self.engines = [
            Engine(config, self.clock, engine_rng(seed, pod)) for pod, config in enumerate(configs)
        ]

    def snapshots(self) -> list[EngineSnapshot]:
        """Every pod's state now."""
        return [engine.snapshot() for engine in self.engines]

    def run(
        self,
        arrivals: Iterable[Arrival],
        router: Router | None = None,
        on_step: StepObserver | None = None,
        snapshot_interval: float = 0.0,
    ) -> RunResult:
        """Play ``arrivals`` until every request is done; ``on_step(pod, result)`` sees steps."""
        wall_start = time.perf_counter()
        ordered = sorted(arrivals, key=lambda arrival: arrival.time)
        engines = self.engines
        loop = EventLoop(engines, self.clock, on_step)
        records: list[tuple[int, Arrival, Request | None, str | None]] = []
        snapshots: list[EngineSnapshot] = []
        snapshot_time = -math.inf
        next_pod = 0

        def arrive(now: float, position: int) -> None:
            nonlocal snapshots, snapshot_time, next_pod
            arrival = ordered[position]
            if position + 1 < len(ordered):
                loop.at(ordered[position + 1].time, ARRIVAL, arrive, position + 1)
            pod = arrival.pod
            if pod is None:
                if router is None:
                    pod = next_pod
                    next_pod = (next_pod + 1) % len(engines)
                else:
                    if now - snapshot_time >= snapshot_interval or not snapshots:
                        snapshots = self.snapshots()
                        snapshot_time = now
                    pod = router(arrival, snapshots)
            try:
                request = engines[pod].submit(arrival.spec)
            except RequestRejected as error:
                records.append((pod, arrival, None, str(error)))
                return
            records.append((pod, arrival, request, None))
            loop.kick(pod)

        if ordered:
            loop.at(ordered[0].time, ARRIVAL, arrive, 0)
        loop.run()
        return RunResult(
            requests=tuple(_result(*record) for record in records),
            pods=tuple(msgspec.structs.replace(engine.counters) for engine in engines),
            end_time=self.clock.now(),
            wall_seconds=time.perf_counter() - wall_start,
        )


# Orders of events at the same instant (after the steps that end then): the collector's
# scrapes, then deliveries of what was sent earlier (snapshots, peers' decisions), then arrivals.
SCRAPE, DELIVERY, ARRIVAL = 0, 1, 2

Event = Callable[[float, Any], None]


class EventLoop:
    """The one discrete-event loop of a virtual run: engine steps and timed events, one clock.

    At each instant it ends the steps that end then (``on_step`` sees each), runs the events due
    (by ``order``, then in the order they were scheduled; an event may schedule more at the same
    instant), then begins a step on every idle pod that was :meth:`kick`-ed. It returns when no
    step and no event is left. Used by :class:`VirtualFleet` and by ``lig bench``'s fleet.
    """

    def __init__(self, engines: Sequence[Engine], clock: VirtualClock,
                 on_step: StepObserver | None = None) -> None:
        self.engines = engines
        self.clock = clock
        self.on_step = on_step
        self._events: list[tuple[float, int, int, Event, Any]] = []
        self._serial = 0
        self._ends: list[tuple[float, int]] = []
        self._busy = [False] * len(engines)
        self._kicked: list[int] = []

    def at(self, when: float, order: int, event: Event, argument: Any = None) -> None:
        """Run ``event(now, argument)`` at virtual time ``when`` (not before the present)."""
        self._serial += 1
        heapq.heappush(self._events, (when, order, self._serial, event, argument))

    def kick(self, pod: int) -> None:
        """Pod ``pod`` may have new work: begin a step on it at the end of this instant."""
        self._kicked.append(pod)

    def run(self) -> None:
        """Advance until nothing is left to do."""
        engines, clock, events, ends, busy = (self.engines, self.clock, self._events, self._ends,
                                              self._busy)
        on_step, inf = self.on_step, math.inf
        while events or ends:
            now = min(events[0][0] if events else inf, ends[0][0] if ends else inf)
            clock.advance_to(now)
            kicked = self._kicked
            while ends and ends[0][0] <= now:
                pod = heapq.heappop(ends)[1]
                result = engines[pod].finish_step()
                busy[pod] = False
                kicked.append(pod)
                if on_step is not None:
                    on_step(pod, result)
            while events and events[0][0] <= now:
                _, _, _, event, argument = heapq.heappop(events)
                event(now, argument)
            for pod in kicked:
                if not busy[pod]:
                    plan = engines[pod].begin_step()
                    if plan is not None:
                        busy[pod] = True
                        heapq.heappush(ends, (plan.end, pod))
            kicked.clear()

    def busy(self, pod: int) -> bool:
        """Whether pod ``pod`` is running a step now."""
        return self._busy[pod]


def _result(pod: int, arrival: Arrival, request: Request | None, why: str | None) -> RequestResult:
    if request is None:
        return RequestResult(arrival.spec.request_id, pod, arrival.time, rejected=why)
    first = request.first_token_time
    arrived = request.arrival_time
    outputs = request.num_output
    return RequestResult(
        request_id=request.request_id,
        pod=pod,
        arrival_time=arrived,
        finish_reason=request.finish_reason,
        prompt_tokens=request.num_prompt_tokens,
        output_tokens=outputs,
        cached_tokens=max(request.num_cached_tokens, 0),
        preemptions=request.preemptions,
        queue_time=None
        if request.first_scheduled_time is None
        else request.first_scheduled_time - arrived,
        ttft=None if first is None else first - arrived,
        e2e=None if request.finish_time is None else request.finish_time - arrived,
        itl_mean=(request.last_token_time - first) / (outputs - 1)
        if first is not None and outputs > 1
        else None,
        itl_max=request.max_gap if outputs > 1 else None,
        token_times=None if request.token_times is None else tuple(request.token_times),
    )
