"""One picker, several pools: resolve the requested model to its pool, then run that pool's router.

Each served pool keeps its own :class:`~services.picker.routing.Router` (policy, thresholds) and
:class:`~services.picker.state.PodTable` (snapshots, load estimate, gray pods). The
:class:`Gateway` adds what spans pools:

- **The model index**: model name -> pool, over the served pools. A name registered in two
  served pools is a conflict: it is logged, counted, and the name keeps the pool it had before
  (the last good state); a name new to the index in a conflict gets no pool until it is resolved.
- **Unknown models** (:class:`UnknownModels`): rejected with 404, or passed to a default pool,
  which then applies its own ``rejectUnknownModels`` field (the per-pool behaviour of a
  one-pool picker). Without a setting, a picker that serves exactly one pool treats that pool as
  the default, as before; with several it answers 404.
- **Requests without a body**: ``GET /v1/models`` (and ``GET /v1/models/<id>``) are answered
  from the registry in the OpenAI list shape; others go to a pod of the default pool (or of the
  first pool, by name, that has a pod).

- **The decision stream**: ``on_decision(pool, event)`` hears of every request routed, finished
  or shed (the publisher of ``services/picker/decision_stream.py``); :meth:`Gateway.apply_peer`
  counts a peer picker's decisions in the pools' tables (``services/picker/peer_decisions.py``).
- **The flight recorder**: ``on_record(pool, record)`` gets each router's decision records and,
  when a routed request ends, its :class:`~scheduling.record.OutcomeRecord`.

A picker given no pool serves every pool of the registry (pools appear as the registry publishes
them, and are dropped once the registry has nothing left of them).
"""

from __future__ import annotations

import logging
import random
import time
import urllib.parse
from collections.abc import Callable, Iterable, Sequence

import msgspec

from scheduling.record import OutcomeRecord
from services.picker.conformance import SELECTION_HEADER, Selection
from services.picker.peer_decisions import DEFAULT_REQUEST_TTL, PeerDecisions
from services.picker.routing import (
    Answered,
    DecisionCallback,
    RecordCallback,
    Rejected,
    Routed,
    Router,
    read_request,
    reject,
)
from services.picker.state import Freshness, PodTable
from shared.registry_view import RegistryChanges, RegistryView
from shared.schemas import DecisionBatch, FinishedEvent, RoutedEvent

log = logging.getLogger("lig.picker.pools")

MODELS_PATH = "/v1/models"


class UnknownModels(msgspec.Struct, frozen=True):
    """What happens to a request for a model no served pool registers.

    ``reject``: 404 always. Else ``default_pool`` (or the only served pool when None) takes it,
    applying its own ``reject_unknown_models``; with neither, 404.
    """

    reject: bool = False
    default_pool: str | None = None


class ModelConflict(msgspec.Struct, frozen=True):
    """A model name registered in several served pools, and the pool it stays with (if any)."""

    model: str
    pools: tuple[str, ...]
    kept: str | None


class _ModelEntry(msgspec.Struct):
    id: str
    owned_by: str
    object: str = "model"
    created: int = 0


class _ModelList(msgspec.Struct):
    data: list[_ModelEntry]
    object: str = "list"


class Gateway:
    """Routes requests for the models of several pools, each pool with its own router.

    ``pools`` are the pools served (empty: every pool of the registry); ``make_router(pool)``
    builds a pool's router and pod table; ``on_conflicts(count)`` gets the number of model names
    in conflict after every registry update that changed it. ``on_decision`` (None: nobody
    listens) hears of each request routed, finished or shed; ``picker_id`` names this picker in
    the decision stream, so that its own batches coming back are not counted twice; ``clock``
    times peers' silence and requests for their expiry (virtual time in a simulation).
    ``on_record`` (None: recording off) gets the flight recorder's decision and outcome records.
    """

    def __init__(self, pools: Sequence[str], make_router: Callable[[str], Router],
                 unknown: UnknownModels | None = None, rng: random.Random | None = None,
                 on_conflicts: Callable[[int], None] = lambda count: None,
                 on_decision: DecisionCallback | None = None, picker_id: str = "",
                 clock: Callable[[], float] = time.monotonic,
                 request_ttl: float = DEFAULT_REQUEST_TTL,
                 on_record: RecordCallback | None = None) -> None:
        self.all_pools = not pools
        self.on_decision = on_decision
        self.on_record = on_record
        self.peers = PeerDecisions(picker_id, self.router, clock, request_ttl)
        self._make_router = make_router
        self.unknown = unknown if unknown is not None else UnknownModels()
        self._rng = rng if rng is not None else random.Random()
        self._on_conflicts = on_conflicts
        self.routers: dict[str, Router] = {}
        for pool in pools:
            self._add(pool)
        if self.unknown.default_pool is not None and not self.unknown.reject:
            if not self.all_pools and self.unknown.default_pool not in self.routers:
                raise ValueError(f"the default pool {self.unknown.default_pool!r} is not one "
                                 f"of the pools served ({', '.join(pools)})")
            self._add(self.unknown.default_pool)
        self.owner: dict[str, str] = {}  # model name -> pool
        self.conflicts: dict[str, ModelConflict] = {}
        self._model_list: bytes | None = None

    @classmethod
    def serving(cls, router: Router, unknown: UnknownModels | None = None) -> Gateway:
        """A gateway over one existing router (tests and tools built around one pool)."""
        return cls([router.pool_name], lambda pool: router, unknown)

    def _add(self, pool: str) -> Router:
        router = self.routers.get(pool)
        if router is None:
            router = self.routers[pool] = self._make_router(pool)
            router.on_decision = self.on_decision
            router.on_record = self.on_record
        return router

    # --- registry --------------------------------------------------------------------------

    def update(self, view: RegistryView, changes: RegistryChanges | None = None) -> None:
        """Apply a registry change to every served pool, then to the model index."""
        if changes is None:
            changes = RegistryChanges(everything=True)
        added = []
        if self.all_pools:
            for pool in view.pools.keys() - self.routers.keys():
                self._add(pool)
                added.append(pool)
            self._drop_removed(view)
        for pool, router in self.routers.items():
            router.update(view, None if pool in added else changes)
        if changes.everything or added:
            names: Iterable[str] = {name for pool in self.routers
                                    for name in view.models.get(pool, {})} | self.owner.keys()
        else:
            names = {name for pool, changed in changes.models.items() if pool in self.routers
                     for name in changed}
        before = len(self.conflicts)
        changed = False
        for name in names:
            changed |= self._index(name)
        if changed:
            self._model_list = None
        if before or self.conflicts:
            self._on_conflicts(len(self.conflicts))

    def _drop_removed(self, view: RegistryView) -> None:
        """Serving every pool: forget pools the registry no longer has at all (no pool, no
        models, no endpoints), so that they stop counting as served (e.g. as the only pool)."""
        for pool in list(self.routers):
            if (pool not in view.pools and not view.models.get(pool) and pool not in view.endpoints
                    and pool != self.unknown.default_pool):
                del self.routers[pool]
                log.info("pool %s is gone from the registry; no longer served", pool)

    def _index(self, name: str) -> bool:
        """Re-resolve one model name's pool; True when the index changed."""
        pools = tuple(sorted(pool for pool, router in self.routers.items()
                             if router.serves(name)))
        old = self.owner.get(name)
        if len(pools) <= 1:
            if self.conflicts.pop(name, None) is not None:
                log.info("model %r: the conflict is resolved; it is served by %s", name,
                         pools[0] if pools else "no pool")
            if pools:
                self.owner[name] = pools[0]
            else:
                self.owner.pop(name, None)
            return old != (pools[0] if pools else None)
        kept = old if old in pools else None
        conflict = ModelConflict(name, pools, kept)
        if self.conflicts.get(name) != conflict:
            log.error("model name conflict: %r is registered in pools %s; model names must be "
                      "unique across the pools a picker serves. %s", name, ", ".join(pools),
                      f"It stays with pool {kept} (the last good state)" if kept else
                      "It is not routed until the conflict is resolved")
        self.conflicts[name] = conflict
        if kept is None:
            self.owner.pop(name, None)
        return old != kept

    # --- requests --------------------------------------------------------------------------

    def route(self, body: bytes, subset: frozenset[str] | None = None,
              objective: str | None = None, request_id: str = "",
              selection: Selection | None = None) -> Routed | Rejected:
        """Decide where a request with this JSON ``body`` goes (``subset``, ``objective`` and
        ``request_id``: see :meth:`Router.route`; ``selection``: the conformance suite's
        endpoint selection, see :mod:`services.picker.conformance`)."""
        fields = read_request(body)
        if isinstance(fields, Rejected):
            return fields
        requested = fields.model or ""
        pool = self.owner.get(requested)
        router = self.routers[pool] if pool is not None else self._default_router()
        if router is not None:
            limited = _limit(router, subset, selection, requested)
            if isinstance(limited, Rejected):
                return limited
            return router.route_model(body, requested, limited, objective, fields, request_id)
        quoted = msgspec.json.encode(requested).decode()
        reason = (" (registered in several pools: " + ", ".join(self.conflicts[requested].pools)
                  + ")" if requested in self.conflicts else "")
        return reject(404, f"model {quoted} is not served by this gateway{reason}",
                      "model_not_found", requested)

    def _default_router(self) -> Router | None:
        if self.unknown.reject:
            return None
        if self.unknown.default_pool is not None:
            return self.routers[self.unknown.default_pool]
        if len(self.routers) == 1:
            return next(iter(self.routers.values()))
        return None

    def route_bodiless(self, method: str = "GET", path: str = "/",
                       subset: frozenset[str] | None = None,
                       selection: Selection | None = None) -> Routed | Rejected:
        """A request without a body: the model list, one model, or any pod (see module doc) of
        the ``subset`` hint and the ``selection`` when given."""
        route_path = urllib.parse.unquote(path.partition("?")[0])
        if method == "GET" and route_path in (MODELS_PATH, MODELS_PATH + "/"):
            return Answered(200, "models", self.model_list())
        if method == "GET" and route_path.startswith(MODELS_PATH + "/"):
            return self._one_model(route_path[len(MODELS_PATH) + 1:])
        router = self._default_router()
        routers = [router] if router is not None else [self.routers[p]
                                                       for p in sorted(self.routers)]
        answer: Routed | Rejected = reject(503, "no pool has a ready endpoint",
                                           "no_ready_endpoint")
        for router in routers:
            limited = _limit(router, subset, selection)
            answer = limited if isinstance(limited, Rejected) else router.route_bodiless(limited)
            if isinstance(answer, Routed):
                return answer
        return answer

    def model_list(self) -> bytes:
        """``{"object": "list", "data": [...]}``: every routed model name, ``owned_by`` its pool."""
        if self._model_list is None:
            entries = [_ModelEntry(name, pool) for name, pool in sorted(self.owner.items())]
            self._model_list = msgspec.json.encode(_ModelList(entries))
        return self._model_list

    def _one_model(self, name: str) -> Answered | Rejected:
        pool = self.owner.get(name)
        if pool is None:
            quoted = msgspec.json.encode(name).decode()
            return reject(404, f"model {quoted} is not served by this gateway",
                          "model_not_found", name)
        return Answered(200, "models", msgspec.json.encode(_ModelEntry(name, pool)), name, name,
                        True, pool)

    # --- pod bookkeeping (per pool) ----------------------------------------------------------

    def router(self, pool: str) -> Router | None:
        """The router of ``pool``, None when it is not served."""
        return self.routers.get(pool)

    def table(self, pool: str) -> PodTable | None:
        """The pod table of ``pool``, None when it is not served."""
        router = self.routers.get(pool)
        return router.pods if router is not None else None

    def started(self, routed: Routed) -> None:
        """A request was sent to ``routed``'s pod."""
        pods = self.table(routed.pool)
        if pods is not None:
            pods.started(routed.pod, routed.prefill_on(routed.pod))
            if self.on_decision is not None:
                self.on_decision(routed.pool, _routed_event(routed))

    def finished(self, routed: Routed, prompt_tokens: int = 0,
                 completion_tokens: int | None = None, response: ResponseSeen | None = None,
                 cached_tokens: int | None = None) -> None:
        """The request sent to ``routed``'s pod has ended (with the token usage its response
        reported, when known, and what the picker saw of the response, for its outcome
        record; ``cached_tokens``: the prompt tokens the pod reported found in its cache)."""
        pods = self.table(routed.pool)
        if pods is not None:
            pods.finished(routed.pod)
            if self.on_decision is not None:
                self.on_decision(routed.pool, FinishedEvent(
                    routed.request_id, routed.pod, prompt_tokens, completion_tokens))
            if self.on_record is not None and routed.decided_ns:
                self.on_record(routed.pool, _outcome(routed, prompt_tokens, completion_tokens,
                                                     response, cached_tokens))

    def served_elsewhere(self, routed: Routed, pod: str) -> None:
        """The request routed as ``routed`` was served by member ``pod`` of its pool (the
        gateway went down the fallback list): it is accounted there from now on. Peers hear
        of it as the same request routed again, to ``pod``."""
        pods = self.table(routed.pool)
        if pods is not None:
            pods.served_elsewhere(routed.pod, pod, routed.prefill_on(routed.pod),
                                  routed.prefill_on(pod))
            if self.on_decision is not None:
                self.on_decision(routed.pool, _routed_event(routed, pod))

    def apply_peer(self, batch: DecisionBatch) -> None:
        """Count a peer picker's decisions as if they were ours (our own batches are
        ignored); see :class:`~services.picker.peer_decisions.PeerDecisions`."""
        self.peers.apply(batch)

    def expire_peers(self) -> int:
        """Forget what silent peers contributed, and peers' requests past their TTL."""
        return self.peers.expire()

    def responded(self, routed: Routed, status: int) -> None:
        """The response to a request sent to ``routed``'s pod started with ``status``."""
        pods = self.table(routed.pool)
        if pods is not None:
            pods.responded(routed.pod, status)

    def wants_outcome(self) -> bool:
        """Whether the request being routed (its pool still unknown) should report its status:
        asked of every pool, so that each pool's sampling and probation see every request."""
        wanted = False
        for router in self.routers.values():
            wanted |= router.pods.wants_outcome()
        return wanted

    def has_member_snapshot(self) -> bool:
        """True once any member pod of any served pool has a snapshot (part of readiness)."""
        return any(router.pods.has_member_snapshot() for router in self.routers.values())

    def freshness(self) -> dict[str, Freshness]:
        """Each pool's freshness (see :meth:`PodTable.freshness`)."""
        return {pool: router.pods.freshness() for pool, router in self.routers.items()}

    def in_flight(self) -> dict[str, int]:
        """Requests in flight per pod, over every pool."""
        counts: dict[str, int] = {}
        for router in self.routers.values():
            counts.update(router.pods.in_flight())
        return counts


class ResponseSeen(msgspec.Struct):
    """What a request's ext_proc stream saw of its response: the status (0: none seen) and
    when the first body byte passed (perf_counter_ns; 0: none seen)."""

    status: int = 0
    first_byte_ns: int = 0


def _outcome(routed: Routed, prompt_tokens: int, completion_tokens: int | None,
             response: ResponseSeen | None, cached_tokens: int | None) -> OutcomeRecord:
    """The outcome record of ``routed``, ending now; usage None when the response reported
    none (``completion_tokens`` None)."""
    start = routed.decided_ns
    status, first_byte = (response.status, response.first_byte_ns) if response else (0, 0)
    known = completion_tokens is not None
    return OutcomeRecord(
        routed.envoy_request_id, routed.request_id, routed.pod, status,
        (first_byte - start) / 1e6 if first_byte else None,
        (time.perf_counter_ns() - start) / 1e6,
        prompt_tokens if known else None, completion_tokens,
        cached_tokens, routed.cached_on(routed.pod))


def _routed_event(routed: Routed, pod: str | None = None) -> RoutedEvent:
    served = routed.pod if pod is None else pod
    prefill = routed.prefill_on(served)
    return RoutedEvent(routed.request_id, served, routed.target_model, routed.criticality,
                       routed.prompt_tokens, routed.max_tokens, routed.prefix_hashes,
                       # None (one byte) says "all of them", the usual case
                       None if prefill == routed.prompt_tokens else prefill)


def _limit(router: Router, subset: frozenset[str] | None, selection: Selection | None,
           model: str = "") -> frozenset[str] | Rejected | None:
    """The endpoints ``router`` may pick among: the gateway's subset hint, narrowed to the
    members the conformance ``selection`` names (a 400 when it names none of them; a pool
    without members is left to answer its own 503)."""
    if selection is None or not router.pods.endpoints:
        return subset
    chosen = selection.members(router.pods.endpoints)
    if not chosen:
        # The header may be 16 KiB: enough of it to recognise it.
        return reject(400, f"the {SELECTION_HEADER} header names no endpoint of pool "
                      f"{msgspec.json.encode(router.pool_name).decode()}: "
                      f"{selection.text[:200]}",
                      "test_endpoint_not_in_pool", model)
    return chosen if subset is None else chosen & subset
