"""The simulated fleet: N engines in virtual time behind pickers that run the real policy code.

What is modelled, and how it maps to production:

- Each pod is a ``simulator.engine.Engine`` (vLLM V1's scheduler and step-time model).
- The collector scrapes every pod each ``scrape_interval`` seconds (each pod at its own seeded
  phase, as the collector's per-pod loops drift apart); a snapshot reaches the pickers
  ``propagation_delay`` seconds later (scrape duration plus the NATS hop). Until the next one
  arrives, a picker decides on that snapshot: staleness is up to ``interval + delay``.
- Every picker replica subscribes to the same snapshots (one collector stream), and keeps its
  own policy instance with its own random source and round-robin cursor, and its own in-flight
  counts: +1 when it sends a request to a pod, -1 when the response ends, as the picker's
  ``PodTable`` does. Requests are spread over replicas uniformly at random (Envoy balancing
  its ext_proc streams).
- Unless ``load_estimate`` is off, each replica also counts the requests it sent to a pod since
  that pod's newest snapshot arrived, in the pod's ``waiting`` (``services/picker/load_estimate``,
  the same code as ``lig picker``; off is ``lig picker --no-load-estimate``).
- A decision costs no virtual time, and a chosen request reaches its pod at once.

Events at the same instant run in this order: steps that end, scrapes, snapshot deliveries,
arrivals, then a new step on every idle pod with work.
"""

from __future__ import annotations

import enum
import heapq
import math
import random
import time
from collections import deque
from collections.abc import Sequence

import msgspec

from scheduling import PodView, Policy, build_policy
from scheduling_bench.workloads import BenchRequest
from services.picker.load_estimate import UnreportedLoad, picker_views
from shared.schemas import PolicyConfig
from simulator.engine import Engine, EngineConfig, EngineCounters, Request, RequestRejected
from simulator.virtual_time import VirtualClock, engine_rng


class FleetConfig(msgspec.Struct, frozen=True):
    """The fleet around the policy: pods, picker replicas, metric freshness, engine settings."""

    pods: int = 8
    pickers: int = 1
    scrape_interval: float = 0.05
    """Seconds between two scrapes of a pod (``lig collector --interval``)."""
    propagation_delay: float = 0.005
    """Seconds from a scrape's start until the pickers have its snapshot."""
    load_estimate: bool = True
    """Pickers count the requests their pods have not reported yet as waiting (see
    ``services/picker/load_estimate.py``)."""
    engine: EngineConfig = EngineConfig()


class Outcome(enum.IntEnum):
    """What happened to a request."""

    COMPLETED = 0
    SHED = 1
    """The policy dropped it (the picker answers 429)."""
    NO_POD = 2
    """The policy found no pod and did not shed (the picker answers 503)."""
    REJECTED = 3
    """The chosen pod refused it (vLLM answers 400)."""


class FleetRun:
    """The raw result of one run: per request its outcome and engine record, per pod counters."""

    def __init__(
        self,
        requests: Sequence[BenchRequest],
        outcomes: list[Outcome],
        records: list[Request | None],
        counters: list[EngineCounters],
        end_time: float,
        wall_seconds: float,
    ) -> None:
        self.requests = requests
        self.outcomes = outcomes
        # The engine's Request for each routed request (None when shed, 503 or 400).
        self.records = records
        self.counters = counters
        self.end_time = end_time
        self.wall_seconds = wall_seconds


class PickerReplica:
    """One picker: a policy instance, and in-flight counts and unreported load of its requests."""

    def __init__(self, policy: Policy, load_estimate: bool) -> None:
        self.policy = policy
        self.in_flight: dict[str, int] = {}
        self.unreported = UnreportedLoad(load_estimate)

    def sent(self, pod: str) -> None:
        """A request went to ``pod`` (``PodTable.started``)."""
        self.in_flight[pod] = self.in_flight.get(pod, 0) + 1
        self.unreported.routed(pod)

    def ended(self, pod: str) -> None:
        """A request to ``pod`` finished (``PodTable.finished``)."""
        self.in_flight[pod] -= 1

    def views(self, snapshots: list[PodView]) -> list[PodView]:
        """The pod views this replica's policy sees, as ``PodTable.fresh_views`` builds them."""
        return picker_views(snapshots, self.in_flight, self.unreported.counts)


def simulate(
    requests: Sequence[BenchRequest], policy: PolicyConfig, config: FleetConfig, seed: int
) -> FleetRun:
    """Play ``requests`` (sorted by time) through the fleet until every one has ended."""
    return _Simulation(requests, policy, config, seed).run()


class _Simulation:
    """One run's state: engines on one virtual clock, picker replicas, scrape schedule."""

    def __init__(
        self,
        requests: Sequence[BenchRequest],
        policy: PolicyConfig,
        config: FleetConfig,
        seed: int,
    ) -> None:
        if config.pods < 1 or config.pickers < 1:
            raise ValueError("a fleet needs at least one pod and one picker")
        if config.scrape_interval <= 0 or config.propagation_delay < 0:
            raise ValueError("scrape_interval must be > 0 and propagation_delay >= 0")
        self.requests = requests
        self.config = config
        self.clock = VirtualClock()
        self.engines = [
            Engine(config.engine, self.clock, engine_rng(seed, pod)) for pod in range(config.pods)
        ]
        self.names = [f"pod-{pod}" for pod in range(config.pods)]
        self.index = {name: pod for pod, name in enumerate(self.names)}
        self.pickers = [
            PickerReplica(
                build_policy(policy, random.Random(f"policy/{seed}/{replica}")),
                config.load_estimate,
            )
            for replica in range(config.pickers)
        ]
        self.spread = random.Random(f"spread/{seed}")
        phases = random.Random(f"scrape-phase/{seed}")
        pods = range(config.pods)
        self.scrapes = [(phases.uniform(0, config.scrape_interval), pod) for pod in pods]
        heapq.heapify(self.scrapes)
        # The pickers start with one snapshot of the idle fleet, as a ready picker has.
        self.scraped = [self.view(pod) for pod in pods]
        self.delivered = list(self.scraped)
        self.dirty = [False] * config.pods

    def view(self, pod: int) -> PodView:
        """What a scrape of ``pod`` shows now, as the picker's ``PodView``."""
        snapshot = self.engines[pod].snapshot()
        return PodView(
            name=self.names[pod],
            address=f"10.0.0.{pod + 1}:8000",
            waiting=snapshot.waiting,
            running=snapshot.running,
            kv_cache_usage=snapshot.kv_cache_usage,
            running_adapters=snapshot.running_adapters,
            waiting_adapters=snapshot.waiting_adapters,
            max_lora=snapshot.max_lora,
        )

    def run(self) -> FleetRun:
        wall_start = time.perf_counter()
        requests, engines, clock = self.requests, self.engines, self.clock
        interval, delay = self.config.scrape_interval, self.config.propagation_delay
        pickers, spread = self.pickers, self.spread.randrange
        scrapes, scraped, delivered, dirty = self.scrapes, self.scraped, self.delivered, self.dirty
        deliveries: deque[tuple[float, int, PodView]] = deque()
        ends: list[tuple[float, int]] = []
        busy = [False] * len(engines)
        owner: dict[int, PickerReplica] = {}  # id(engine request) -> replica that routed it
        outcomes: list[Outcome] = []
        records: list[Request | None] = []
        count, position = len(requests), 0
        inf = math.inf
        while position < count or ends:
            next_arrival = requests[position].time if position < count else inf
            next_end = ends[0][0] if ends else inf
            next_delivery = deliveries[0][0] if deliveries else inf
            now = min(next_arrival, next_end, scrapes[0][0], next_delivery)
            clock.advance_to(now)
            kicked: list[int] = []
            while ends and ends[0][0] <= now:
                pod = heapq.heappop(ends)[1]
                result = engines[pod].finish_step()
                busy[pod] = False
                dirty[pod] = True
                for request in result.finished:
                    owner.pop(id(request)).ended(self.names[pod])
                kicked.append(pod)
            while scrapes[0][0] <= now:
                when, pod = scrapes[0]
                heapq.heapreplace(scrapes, (when + interval, pod))
                if dirty[pod]:
                    scraped[pod] = self.view(pod)
                    dirty[pod] = False
                    deliveries.append((now + delay, pod, scraped[pod]))
            while deliveries and deliveries[0][0] <= now:
                _, pod, view = deliveries.popleft()
                delivered[pod] = view
                for picker in pickers:
                    picker.unreported.reported(view.name)
            while position < count and requests[position].time <= now:
                bench_request = requests[position]
                position += 1
                picker = pickers[spread(len(pickers))] if len(pickers) > 1 else pickers[0]
                decision = picker.policy.schedule(bench_request.scheduling, picker.views(delivered))
                if decision.pick is None:
                    outcomes.append(Outcome.SHED if decision.shed else Outcome.NO_POD)
                    records.append(None)
                    continue
                pod = self.index[decision.pick.name]
                try:
                    request = engines[pod].submit(bench_request.spec)
                except RequestRejected:
                    outcomes.append(Outcome.REJECTED)
                    records.append(None)
                    continue
                outcomes.append(Outcome.COMPLETED)
                records.append(request)
                owner[id(request)] = picker
                picker.sent(decision.pick.name)
                dirty[pod] = True
                kicked.append(pod)
            for pod in kicked:
                if not busy[pod]:
                    plan = engines[pod].begin_step()
                    if plan is not None:
                        busy[pod] = True
                        dirty[pod] = True
                        heapq.heappush(ends, (plan.end, pod))
        if any(engine.has_work for engine in engines):
            raise RuntimeError("the simulation stopped with requests left in an engine")
        return FleetRun(
            requests=requests,
            outcomes=outcomes,
            records=records,
            counters=[msgspec.structs.replace(engine.counters) for engine in engines],
            end_time=clock.now(),
            wall_seconds=time.perf_counter() - wall_start,
        )
