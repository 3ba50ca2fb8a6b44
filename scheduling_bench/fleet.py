"""The simulated fleet: N engines in virtual time behind picker replicas that are the real picker.

What is modelled, and how it maps to production:

- Each pod is a ``simulator.engine.Engine`` (vLLM V1's scheduler and step-time model).
- Each picker replica is the picker's decision core (``services.picker.core.build_gateway``: the
  ``Gateway``, ``Router`` and ``PodTable`` ext_proc calls), with the defaults of ``lig picker``,
  on the run's virtual clock (snapshot freshness, gray pods). It learns the pool, its models,
  the InferenceObjectives (one per criticality) and the pods from a registry view, as the picker
  does from the registry's KV bucket.
- A request reaches a replica (Envoy balancing its ext_proc streams: uniformly at random) as the
  client sent it: an OpenAI body with the prompt's text and the objective header. The replica
  routes it (model resolution with the weighted draw, criticality, the pool's policy); a 429 is
  a shed, a 503 a request no pod took. The chosen pod computes the resolved target (base model
  or adapter). The replica counts the request in flight from then until the engine finishes it
  (``Gateway.started`` / ``finished``, as ext_proc does at the response's end).
- The collector scrapes every pod each ``scrape_interval`` seconds (each pod at its own seeded
  phase) into the ``PodMetrics`` the collector publishes; ``propagation_delay`` later every
  replica decodes and applies it (``SnapshotSink``, as from NATS).
- ``oracle``: before each decision the deciding replica also gets a snapshot of every pod's exact
  state at that instant: the bound no scrape-fed picker can beat (with ``prefix`` "precise", it
  also gets every KV-cache event at once: no event delay).
- ``prefix``: where the replicas' prefix matches come from. "approximate" (``lig picker``'s
  default): each replica's prefix index of the prompt blocks it sent where. "precise": the pods'
  KV-cache events (``scheduling_bench/kv_feed.py``): after each engine step, the blocks it
  cached or evicted reach every replica's precise index ``kv_event_delay`` seconds later, as
  ``lig sim`` -> ``lig kv-events`` -> NATS delivers them; the replicas read prompts of token ids
  (workloads with ``token_ids``) through :class:`~scheduling_bench.kv_feed.TokenIdPrompts`, and
  run without the approximate index, so that the matches are the events' alone.
  "none": no prefix index (``lig picker --prefix-index-entries 0``), the same policy blind to
  prefixes.
- ``shared_decisions`` (with a core that supports the decision stream): each replica's own
  routed/finished/shed events reach every other replica ``decision_delay`` seconds later
  (``Gateway.apply_peer``), as the decision stream on NATS delivers them.
- Multi-turn: a conversation's next turn arrives ``think`` seconds after the previous turn's
  answer ended (or after it was refused).
- A decision costs no virtual time, and a chosen request reaches its pod at once.

Everything runs in one discrete-event loop (``simulator.virtual_time.EventLoop``): at one
instant, steps that end, then scrapes, then deliveries (snapshots, peers' decisions), then
arrivals, then a new step on every idle pod with work.
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Sequence
from typing import Literal

import msgspec

from scheduling_bench.kv_feed import KVEventFeed, TokenIdPrompts
from scheduling_bench.workloads import BASE_MODEL, OBJECTIVES, BenchRequest
from services.picker.core import build_gateway
from services.picker.metrics_feed import SnapshotSink
from services.picker.pools import Gateway
from services.picker.routing import DecisionCallback, Rejected, Routed, Router
from services.picker.settings import PickerSettings
from shared.kv_blocks import KVBlockChanges
from shared.registry_view import RegistryView
from shared.schemas import (
    DecisionBatch,
    DecisionEvent,
    Endpoint,
    EndpointSet,
    InferenceModel,
    InferencePool,
    PodMetrics,
    PolicyConfig,
    encode,
)
from simulator.engine import (
    Engine,
    EngineConfig,
    EngineCounters,
    Request,
    RequestRejected,
    StepResult,
)
from simulator.virtual_time import ARRIVAL, DELIVERY, SCRAPE, EventLoop, VirtualClock, engine_rng

POOL = "bench"
PORT = 8000

PrefixSource = Literal["approximate", "precise", "none"]
PREFIX_SOURCES: tuple[PrefixSource, ...] = ("approximate", "precise", "none")
DEFAULT_KV_EVENT_DELAY = 0.03
"""Seconds from the end of the engine step that cached a block until the pickers' precise
indexes hold it. vLLM publishes a step's events when the step's output is processed; then a ZMQ
hop, ``lig kv-events`` (decode, sequence check, NATS publish) and the picker's subscription
(decode, apply): a few milliseconds on one machine (``bench/bench_kv_events.py``), tens across a
cluster with publish batching and a loaded event loop. 30 ms is the middle of that range; the
``--kv-event-delay`` flag varies it."""


class FleetConfig(msgspec.Struct, frozen=True):
    """The fleet around the policy: pods, picker replicas, metric freshness, engine settings."""

    pods: int = 8
    pickers: int = 1
    scrape_interval: float = 0.05
    """Seconds between two scrapes of a pod (``lig collector --interval``)."""
    propagation_delay: float = 0.005
    """Seconds from a scrape's start until the pickers have its snapshot."""
    load_estimate: bool = True
    """``lig picker --load-estimate`` (see ``services/picker/load_estimate.py``)."""
    oracle: bool = False
    """Each decision also sees every pod's exact state at that instant."""
    shared_decisions: bool = True
    """Replicas apply each other's decisions (``lig picker --no-shared-decisions`` is False)."""
    decision_delay: float = 0.002
    """Seconds from a replica's decision until its peers have applied it."""
    prefix: PrefixSource = "approximate"
    """Where prefix matches come from: "approximate", "precise" (KV-cache events) or "none"."""
    kv_event_delay: float = DEFAULT_KV_EVENT_DELAY
    """Seconds from an engine step until its KV-cache events reach the replicas ("precise")."""
    speculative_ttl: float | None = None
    """``lig picker --speculative-ttl`` ("precise"); None: the picker's default."""
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
        shared_decisions: bool = False,
    ) -> None:
        self.requests = requests
        self.outcomes = outcomes
        # The engine's Request for each routed request (None when shed, 503 or 400).
        self.records = records
        self.counters = counters
        self.end_time = end_time
        self.wall_seconds = wall_seconds
        # Whether replicas did share decisions (more than one, asked for, and supported).
        self.shared_decisions = shared_decisions


def simulate(
    requests: Sequence[BenchRequest], policy: PolicyConfig, config: FleetConfig, seed: int
) -> FleetRun:
    """Play ``requests`` through the fleet until every one has ended."""
    return _Simulation(requests, policy, config, seed).run()


def registry_view(policy: PolicyConfig, pods: Sequence[str], models: Sequence[str]) -> RegistryView:
    """The benchmark's registry: one pool with ``policy``, one InferenceObjective per
    criticality, ``models`` registered (each its own target), and ``pods`` as members."""
    view = RegistryView()
    objectives = {name: criticality for criticality, name in OBJECTIVES.items()}
    view.pools[POOL] = InferencePool(name=POOL, target_port=PORT, policy=policy,
                                     objectives=objectives)
    view.models[POOL] = {name: InferenceModel(model_name=name, pool=POOL) for name in models}
    view.endpoints[POOL] = EndpointSet(POOL, tuple(
        Endpoint(name, _address(index), PORT) for index, name in enumerate(pods)))
    return view


def _address(index: int) -> str:
    return f"10.{index >> 16 & 255}.{index >> 8 & 255}.{index & 255}"


class _Replica:
    """One picker replica: its decision core and the sink its snapshots go through."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.sink = SnapshotSink(gateway.table, on_undecodable=_refused, on_wrong_address=_refused)


def _router(gateway: Gateway) -> Router:
    """The replica's router of the bench's pool."""
    router = gateway.router(POOL)
    if router is None:
        raise RuntimeError(f"a picker replica does not serve the pool {POOL}")
    return router


def _picker_id(replica: int) -> str:
    return f"picker-{replica}"


def _refused() -> None:
    """The bench's own snapshot was refused: a bug in the bench, never a result."""
    raise RuntimeError("a picker replica refused a snapshot of the simulated fleet")


class _Simulation:
    """One run's state: engines and picker replicas in one event loop."""

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
        if config.decision_delay < 0 or config.kv_event_delay < 0:
            raise ValueError("decision_delay and kv_event_delay must be >= 0")
        if config.prefix not in PREFIX_SOURCES:
            raise ValueError(f"prefix must be one of {', '.join(PREFIX_SOURCES)}")
        if config.prefix == "precise" and not all(request.token_ids for request in requests):
            # Text prompts would need a tokenizer: the replicas would fall back to the
            # approximate index, and the run would measure that under the precise label.
            raise ValueError("the precise prefix index needs a workload that sends token ids "
                             "(lig bench --token-ids)")
        self.requests = requests
        self.config = config
        self.clock = VirtualClock()
        self.engines = [
            Engine(config.engine, self.clock, engine_rng(seed, pod)) for pod in range(config.pods)
        ]
        self.loop = EventLoop(self.engines, self.clock, self._stepped)
        self.names = [f"pod-{pod}" for pod in range(config.pods)]
        self.index = {name: pod for pod, name in enumerate(self.names)}
        self.seq = [0] * config.pods
        self.shared = config.shared_decisions and config.pickers > 1
        # "precise" runs without the approximate index (which the router would consult for
        # pods without events only, before their first event here): its numbers are the
        # events' alone.
        defaults = PickerSettings()
        settings = PickerSettings(
            pools=[POOL], load_estimate=config.load_estimate,
            prefix_index_entries=defaults.prefix_index_entries
            if config.prefix == "approximate" else 0,
            speculative_ttl=defaults.speculative_ttl if config.speculative_ttl is None
            else config.speculative_ttl)
        view = registry_view(policy, self.names, (BASE_MODEL, *config.engine.adapters))
        self.replicas = []
        for replica in range(config.pickers):
            on_decision = None
            if self.shared:
                on_decision = self._sharer(replica)
            gateway = build_gateway(settings, rng=random.Random(f"policy/{seed}/{replica}"),
                                    clock=self.clock.now, on_decision=on_decision,
                                    picker_id=_picker_id(replica), wall_clock=self._wall_ns)
            gateway.update(view)
            if config.prefix == "precise":
                _router(gateway).tokenizer = TokenIdPrompts()
            self.replicas.append(_Replica(gateway))
        self.feeds: list[KVEventFeed] = []
        if config.prefix == "precise":
            for pod, engine in enumerate(self.engines):
                KVEventFeed.attach(engine.kv)
                self.feeds.append(KVEventFeed(POOL, self.names[pod], f"{_address(pod)}:{PORT}"))
        self.spread = random.Random(f"spread/{seed}")
        self.phases = random.Random(f"scrape-phase/{seed}")
        count = len(requests)
        self.outcomes: list[Outcome | None] = [None] * count
        self.records: list[Request | None] = [None] * count
        self.owner: dict[int, tuple[_Replica, Routed, int]] = {}  # id(engine request) -> routing
        self.unfinished = count  # requests yet to arrive, to be answered or to finish
        self.end_time = 0.0  # when the last request ended

    # --- snapshots ---------------------------------------------------------------------------

    def _wall_ns(self) -> int:
        """The replicas' wall clock: the virtual time, as the scrape and send times are."""
        return round(self.clock.now() * 1e9)

    def _metrics(self, pod: int, now: float) -> bytes:
        """A scrape of ``pod`` now, encoded as the collector publishes it."""
        snapshot = self.engines[pod].snapshot()
        self.seq[pod] += 1
        return encode(PodMetrics(
            pool=POOL,
            pod=self.names[pod],
            address=f"{_address(pod)}:{PORT}",
            seq=self.seq[pod],
            scrape_time_ns=round(now * 1e9),
            scrape_duration_s=0.0,
            ok=True,
            waiting=snapshot.waiting,
            running=snapshot.running,
            kv_cache_usage=snapshot.kv_cache_usage,
            running_adapters=tuple(sorted(snapshot.running_adapters)),
            waiting_adapters=tuple(sorted(snapshot.waiting_adapters)),
            max_lora=snapshot.max_lora or None,
            block_size=snapshot.block_size,
            num_gpu_blocks=snapshot.num_gpu_blocks,
        ))

    def _scrape(self, now: float, pod: int) -> None:
        if self.unfinished:  # the collector scrapes on while any request is to come or running
            self.loop.at(now + self.config.scrape_interval, SCRAPE, self._scrape, pod)
        self.loop.at(now + self.config.propagation_delay, DELIVERY, self._deliver,
                     (pod, self._metrics(pod, now)))

    def _deliver(self, now: float, message: tuple[int, bytes]) -> None:
        pod, data = message
        subject = f"lig.metrics.{POOL}.{self.names[pod]}"
        for replica in self.replicas:
            replica.sink.accept(subject, data)

    # --- KV-cache events ----------------------------------------------------------------------

    def _kv_events(self, now: float, pod: int) -> None:
        """Send the events of the step pod ``pod`` just ended (none: nothing)."""
        changes = self.feeds[pod].take(self.engines[pod].kv, now)
        if changes is None:
            return
        if self.config.oracle:
            self._apply_kv(now, changes)
        else:
            self.loop.at(now + self.config.kv_event_delay, DELIVERY, self._apply_kv, changes)

    def _apply_kv(self, now: float, changes: KVBlockChanges) -> None:
        for replica in self.replicas:
            _router(replica.gateway).precise.apply(changes)

    # --- shared decisions ----------------------------------------------------------------------

    def _sharer(self, source: int) -> DecisionCallback:
        """The ``on_decision`` callback of replica ``source``: its peers apply the event after
        ``decision_delay``."""
        picker = _picker_id(source)

        def share(pool: str, event: DecisionEvent) -> None:
            batch = DecisionBatch(picker=picker, pool=pool,
                                  sent_at_ns=round(self.clock.now() * 1e9), events=[event])
            self.loop.at(self.clock.now() + self.config.decision_delay, DELIVERY,
                         self._apply_peer, (source, batch))

        return share

    def _apply_peer(self, now: float, message: tuple[int, DecisionBatch]) -> None:
        source, batch = message
        for number, replica in enumerate(self.replicas):
            if number != source:
                replica.gateway.apply_peer(batch)

    # --- requests -------------------------------------------------------------------------------

    def _arrive(self, now: float, index: int) -> None:
        requests = self.requests
        following = index + 1
        while following < len(requests) and requests[following].after >= 0:
            following += 1  # follow-up turns arrive after their answers, not in this sequence
        if following < len(requests):
            self.loop.at(requests[following].time, ARRIVAL, self._arrive, following)
        self._route(now, index)

    def _route(self, now: float, index: int) -> None:
        request = self.requests[index]
        replicas = self.replicas
        replica = replicas[self.spread.randrange(len(replicas))] if len(replicas) > 1 else (
            replicas[0])
        if self.config.oracle:
            subject = f"lig.metrics.{POOL}"
            for pod in range(len(self.engines)):
                replica.sink.accept(subject, self._metrics(pod, now))
        routed = replica.gateway.route(request.body(), None, request.objective)
        if isinstance(routed, Rejected):
            if routed.status not in (429, 503):
                raise RuntimeError(f"the picker refused bench request {request.spec.request_id}: "
                                   f"{routed.status} {routed.body.decode(errors='replace')}")
            self._done(now, index, Outcome.SHED if routed.status == 429 else Outcome.NO_POD)
            return
        pod = self.index[routed.pod]
        adapter = None if routed.target_model == BASE_MODEL else routed.target_model
        try:
            record = self.engines[pod].submit(request.engine_spec(adapter))
        except RequestRejected:
            self._done(now, index, Outcome.REJECTED)
            return
        self.outcomes[index] = Outcome.COMPLETED
        self.records[index] = record
        self.owner[id(record)] = (replica, routed, index)
        replica.gateway.started(routed)
        self.loop.kick(pod)

    def _done(self, now: float, index: int, outcome: Outcome) -> None:
        """Request ``index`` ended (``outcome``); its conversation's next turn comes after the
        think time."""
        if outcome is not Outcome.COMPLETED:
            self.outcomes[index] = outcome
        self.unfinished -= 1
        self.end_time = now
        request = self.requests[index]
        if request.then >= 0:
            self.loop.at(now + self.requests[request.then].think, ARRIVAL, self._route,
                         request.then)

    def _stepped(self, pod: int, result: StepResult) -> None:
        now = self.clock.now()
        if self.feeds:
            self._kv_events(now, pod)
        for record in result.finished:
            replica, routed, index = self.owner.pop(id(record))
            replica.gateway.finished(routed)
            self._done(now, index, Outcome.COMPLETED)

    def run(self) -> FleetRun:
        wall_start = time.perf_counter()
        interval = self.config.scrape_interval
        # The pickers start with one snapshot of the idle fleet, as a ready picker has.
        for pod in range(len(self.engines)):
            self._deliver(0.0, (pod, self._metrics(pod, 0.0)))
            self.loop.at(self.phases.uniform(0, interval), SCRAPE, self._scrape, pod)
        first = next((index for index, request in enumerate(self.requests) if request.after < 0),
                     None)
        if first is not None:
            self.loop.at(self.requests[first].time, ARRIVAL, self._arrive, first)
        self.loop.run()
        if self.unfinished or any(engine.has_work for engine in self.engines):
            raise RuntimeError("the simulation stopped with requests left in an engine")
        outcomes = [outcome for outcome in self.outcomes if outcome is not None]
        return FleetRun(
            requests=self.requests,
            outcomes=outcomes,
            records=self.records,
            counters=[msgspec.structs.replace(engine.counters) for engine in self.engines],
            end_time=self.end_time,
            wall_seconds=time.perf_counter() - wall_start,
            shared_decisions=self.shared,
        )
