"""What the picker knows about the pods of its pool: newest snapshot, freshness, requests in flight.

Freshness is judged on this process's monotonic clock at the time a snapshot *arrived*, so clock
skew between the collector's machine and this one cannot make every pod look stale or fresh.

vLLM publishes ``vllm:lora_requests_info`` (hence ``max_lora``) only once it has run a step, so
an idle pod that never served a request reports no LoRA capacity. Read as 0 slots, the filter
tree would never offer such a pod to adapter requests; instead it is assumed to have the largest
capacity any pod of the pool has reported (a pool runs one vLLM configuration).

Unless disabled, a view's ``waiting`` also counts requests this picker routed to the pod since its
newest snapshot (see ``services/picker/load_estimate.py``), and so do the requests peer pickers
report through the decision stream (``services/picker/peer_decisions.py``). Pods whose requests
hang or fail while their metrics look healthy are left out (``services/picker/gray_pods.py``),
unless that would leave no pod at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import msgspec

from scheduling.types import PodView
from services.picker.gray_pods import GrayPods
from services.picker.load_estimate import RecentWork, UnreportedLoad, picker_views
from shared.schemas import Endpoint, PodMetrics


class _PodEntry:
    """The newest snapshot of one pod, its arrival time, when its scrape began (both on this
    process's clock) and the PodView built from it."""

    __slots__ = ("received_at", "scraped_at", "snapshot", "view")

    def __init__(self, snapshot: PodMetrics, received_at: float, scraped_at: float,
                 view: PodView | None) -> None:
        self.snapshot = snapshot
        self.received_at = received_at
        self.scraped_at = scraped_at
        self.view = view  # None when the scrape failed: such a pod is never fresh


class Freshness(msgspec.Struct, frozen=True):
    """How many member pods are fresh and stale now, and each member's snapshot age (seconds)."""

    fresh: int
    stale: int
    ages: dict[str, float]


class PodTable:
    """Member endpoints of one pool with their newest metric snapshots and in-flight counts.

    ``load_estimate=False`` leaves the scraped ``waiting`` uncorrected (upstream's behaviour);
    ``gray`` is the gray-pod guard (its defaults when None). ``wall_clock`` (unix ns; virtual
    in the benchmark) is compared with the snapshots' scrape times to tell how old each one is.
    """

    def __init__(self, stale_after: float, clock: Callable[[], float] = time.monotonic,
                 load_estimate: bool = True, gray: GrayPods | None = None,
                 wall_clock: Callable[[], int] = time.time_ns) -> None:
        self.stale_after = stale_after
        self._clock = clock
        self._wall_clock = wall_clock
        self.peer_lag = 0.0
        """Seconds by which peers' decisions reach this table (0: no live peer); kept by
        :class:`~services.picker.peer_decisions.PeerDecisions`."""
        self.peer_unseen = 0.0
        """Peers' decisions probably taken within their lag and not applied yet (their
        routing rates times their lags); kept by the same."""
        self._entries: dict[str, _PodEntry] = {}
        self._endpoints: dict[str, Endpoint] = {}
        self._endpoint_list: tuple[Endpoint, ...] = ()
        self._members_known = False
        self._in_flight: dict[str, int] = {}  # this picker's and its peers' requests
        self._peer_in_flight: dict[str, int] = {}  # the peers' part of it
        self._unreported = UnreportedLoad(load_estimate)
        self._recent = RecentWork(load_estimate)
        self._max_lora_seen = 0
        self.gray = gray if gray is not None else GrayPods()

    # --- registry membership -------------------------------------------------------------

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        """The pool's current members, as the registry published them."""
        return self._endpoint_list

    @property
    def members_known(self) -> bool:
        """Whether the registry has named the members yet (:meth:`set_endpoints` was called,
        even with none): until then a pod not listed may just not be read yet."""
        return self._members_known

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """Replace the members; snapshots of pods no longer members are forgotten, and so are
        snapshots whose address is not the member's (see :meth:`address_matches`)."""
        self._members_known = True
        self._endpoint_list = tuple(endpoints)
        self._endpoints = {endpoint.name: endpoint for endpoint in self._endpoint_list}
        for name in [name for name, entry in self._entries.items()
                     if not self.address_matches(entry.snapshot, member_only=True)]:
            del self._entries[name]
        self.gray.forget(set(self._endpoints))
        # A snapshot that arrived before the registry named its pod has no view yet.
        for name, entry in self._entries.items():
            entry.view = _view(entry.snapshot, self._endpoints[name])

    # --- snapshots -----------------------------------------------------------------------

    def address_matches(self, snapshot: PodMetrics, member_only: bool = False) -> bool:
        """False when the registry lists ``snapshot``'s pod at another address.

        Snapshots are not trusted to say where a pod is: the registry is. A snapshot about some
        other address (a stale collector, a pod that moved, a forged message) must not describe
        the registered pod. With ``member_only`` a pod the registry does not list fails too.
        """
        endpoint = self._endpoints.get(snapshot.pod)
        if endpoint is None:
            return not member_only
        return snapshot.address == endpoint.hostport

    def registered_address(self, pod: str) -> str | None:
        """The ``ip:port`` the registry lists ``pod`` at (None: not a member)."""
        endpoint = self._endpoints.get(pod)
        return endpoint.hostport if endpoint is not None else None

    def apply(self, snapshot: PodMetrics) -> bool:
        """Keep ``snapshot`` if it is newer than what we have; False when dropped as older.

        A lower sequence number means an out-of-order delivery, unless the scrape time moved
        forward too: then the sequence restarted (a collector restarted or took the pod over).
        """
        current = self._entries.get(snapshot.pod)
        if current is not None:
            old = current.snapshot
            if snapshot.seq <= old.seq and snapshot.scrape_time_ns <= old.scrape_time_ns:
                return False
        endpoint = self._endpoints.get(snapshot.pod)
        view = _view(snapshot, endpoint) if endpoint is not None else None
        if snapshot.max_lora is not None and snapshot.max_lora > self._max_lora_seen:
            self._max_lora_seen = snapshot.max_lora
        now = self._clock()
        scraped_at = now - self.age_of(snapshot.scrape_time_ns)
        self._entries[snapshot.pod] = _PodEntry(snapshot, now, scraped_at, view)
        # Only what was routed before the scrape began can show in it (load_estimate.py).
        self._unreported.reported(snapshot.pod, scraped_at)
        return True

    def age_of(self, wall_ns: int) -> float:
        """Seconds since the wall-clock time ``wall_ns`` (a scrape's start, a peer's batch).

        0 when the clocks disagree: a time ahead of ours, or older than ``stale_after`` (for
        something that has just arrived, a skewed clock rather than a real age), so that a
        skewed clock degrades to judging by arrival, as before ages were read."""
        age = (self._wall_clock() - wall_ns) / 1e9
        return age if 0.0 < age <= self.stale_after else 0.0

    def has_member_snapshot(self) -> bool:
        """True once any current member pod has a snapshot (part of readiness)."""
        return any(name in self._endpoints for name in self._entries)

    def fresh_views(self) -> list[PodView]:
        """Member pods whose newest snapshot is recent and from a successful scrape, without the
        gray ones (unless every one is gray)."""
        now = self._clock()
        oldest = now - self.stale_after
        max_lora_seen = self._max_lora_seen
        views = []
        arrivals = []
        ages = []
        for name in self._endpoints:
            entry = self._entries.get(name)
            if entry is None or entry.view is None or entry.received_at < oldest:
                continue
            view = entry.view
            if entry.snapshot.max_lora is None and max_lora_seen:
                view = msgspec.structs.replace(view, max_lora=max_lora_seen)
            views.append(view)
            arrivals.append(entry.received_at)
            ages.append(now - entry.scraped_at)
        gray = self.gray.excluded(views, now, arrivals)
        if gray and len(gray) < len(views):
            ages = [age for view, age in zip(views, ages, strict=True) if view.name not in gray]
            views = [view for view in views if view.name not in gray]
        return picker_views(views, self._in_flight, self._unreported.counts,
                            self._unreported.tokens, ages, self.peer_lag,
                            self._recent.at(now), self.peer_unseen)

    def freshness(self, wall_clock_ns: int | None = None) -> Freshness:
        """Fresh/stale counts over members and each member's snapshot age (inf when none)."""
        now_ns = time.time_ns() if wall_clock_ns is None else wall_clock_ns
        oldest = self._clock() - self.stale_after
        fresh = 0
        ages: dict[str, float] = {}
        for name in self._endpoints:
            entry = self._entries.get(name)
            if entry is None:
                ages[name] = float("inf")
                continue
            ages[name] = max(0.0, (now_ns - entry.snapshot.scrape_time_ns) / 1e9)
            if entry.view is not None and entry.received_at >= oldest:
                fresh += 1
        return Freshness(fresh=fresh, stale=len(self._endpoints) - fresh, ages=ages)

    # --- requests in flight --------------------------------------------------------------

    def started(self, pod: str, prompt_tokens: int = 0) -> None:
        """Count a request sent to ``pod`` until :meth:`finished`, and it and its
        ``prompt_tokens`` (those the pod must prefill) until the pod's next snapshot."""
        self._in_flight[pod] = self._in_flight.get(pod, 0) + 1
        now = self._clock()
        self._unreported.routed(pod, prompt_tokens, now)
        self._recent.routed(pod, prompt_tokens, now)
        self.gray.started(pod, now)

    def finished(self, pod: str) -> None:
        """The request to ``pod`` has ended (response done or stream closed)."""
        _decrement(self._in_flight, pod)
        self.gray.finished(pod)

    def peer_started(self, pod: str, prompt_tokens: int = 0, lag: float = 0.0) -> bool:
        """A peer picker sent a request to ``pod`` (with ``prompt_tokens``) ``lag`` seconds
        ago: it counts as this picker's own would (in flight until :meth:`peer_finished`,
        unreported with its tokens until a snapshot of the pod scraped after it was routed),
        except for the gray-pod guard, which judges only requests whose outcome this picker
        sees.
        False (nothing counted) when ``pod`` is no member here: a count no snapshot of a
        member would ever clear."""
        if pod not in self._endpoints:
            return False
        self._in_flight[pod] = self._in_flight.get(pod, 0) + 1
        self._peer_in_flight[pod] = self._peer_in_flight.get(pod, 0) + 1
        routed_at = self._clock() - lag
        self._unreported.routed(pod, prompt_tokens, routed_at)
        self._recent.routed(pod, prompt_tokens, routed_at)
        return True

    def peer_finished(self, pod: str) -> None:
        """A request a peer sent to ``pod`` has ended (or its count expired)."""
        _decrement(self._in_flight, pod)
        _decrement(self._peer_in_flight, pod)

    def served_elsewhere(self, routed: str, served: str, prompt_tokens: int = 0,
                         served_tokens: int | None = None) -> None:
        """The request routed to ``routed`` was served by ``served`` (the gateway went down the
        fallback list): its in-flight count moves there, and its load estimate:
        ``prompt_tokens`` counted for ``routed`` leave it, ``served_tokens`` (what ``served``
        must prefill; None: the same) count for ``served``."""
        self.finished(routed)
        self._unreported.unrouted(routed, prompt_tokens)
        self.started(served, prompt_tokens if served_tokens is None else served_tokens)

    def member_at(self, hostport: str) -> Endpoint | None:
        """The member endpoint at ``ip:port`` (None when no member is there)."""
        for endpoint in self._endpoint_list:
            if endpoint.hostport == hostport:
                return endpoint
        return None

    def wants_outcome(self) -> bool:
        """Whether the request being routed should report its response status."""
        return self.gray.wants_outcome(self._clock())

    def responded(self, pod: str, status: int) -> None:
        """The response to a request sent to ``pod`` started with ``status``."""
        self.gray.responded(pod, status, self._clock())

    def in_flight(self) -> dict[str, int]:
        """Requests this picker has in flight per pod (pods with none are absent)."""
        peers = self._peer_in_flight
        own = {pod: count - peers.get(pod, 0) for pod, count in self._in_flight.copy().items()}
        return {pod: count for pod, count in own.items() if count > 0}

    def peer_in_flight(self) -> dict[str, int]:
        """Requests peer pickers have in flight per pod, as their events report them."""
        return self._peer_in_flight.copy()

    def unreported(self) -> dict[str, int]:
        """Requests (this picker's and its peers') routed to each pod since its newest
        snapshot; empty when the load estimate is off."""
        return dict(self._unreported.counts)


def _decrement(counts: dict[str, int], pod: str) -> None:
    """One less for ``pod``; pods at zero leave ``counts``."""
    count = counts.get(pod, 0) - 1
    if count > 0:
        counts[pod] = count
    else:
        counts.pop(pod, None)


def _view(snapshot: PodMetrics, endpoint: Endpoint) -> PodView | None:
    if not snapshot.ok:
        return None
    return PodView(
        name=endpoint.name,
        address=endpoint.hostport,
        waiting=snapshot.waiting,
        running=snapshot.running,
        kv_cache_usage=snapshot.kv_cache_usage,
        running_adapters=frozenset(snapshot.running_adapters),
        waiting_adapters=frozenset(snapshot.waiting_adapters),
        max_lora=snapshot.max_lora or 0,
    )
