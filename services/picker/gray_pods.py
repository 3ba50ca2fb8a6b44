"""Gray pods: pods whose metrics look healthy (often idle) while their requests hang or fail.

A pod that serves ``/metrics`` but never answers a completion looks like the least loaded pod to
every policy, and attracts a large share of the traffic. The picker sees two things the metrics
do not:

- **Requests that do not finish.** Each request this picker routed stays in flight for as long
  as its ext_proc stream lives, which is as long as the HTTP exchange. A request that started
  ``gray_after`` seconds before the pod's newest snapshot arrived started well before that
  snapshot's scrape, so a working pod counts it as running or waiting. (Measured from the
  snapshot's arrival, not from now: a snapshot may be fresh for longer than ``gray_after``.)
  When this picker has more such requests at a pod than the pod reports running and waiting
  together, the pod is not running them: it is gray. (Each picker replica checks only its own
  requests, which the pod's counts include.)
- **Requests that fail.** For one request in ``sample_every`` (and for every request while a pod
  on probation may get it) the picker asks Envoy for the response headers on the routing stream
  and records the status. ``MIN_OUTCOMES`` or more recent outcomes of which at least
  ``FAILURE_RATIO`` are 5xx (Envoy's own 503/504 for an unreachable or silent pod included)
  make the pod gray.

A gray pod is excluded from scheduling for a cool-off (``BASE_COOL_OFF`` seconds, doubling with
every repeat up to ``MAX_COOL_OFF``), then put on probation: it gets one request at a time until
one of them succeeds, which clears it. The exclusion never empties the pool: when every fresh pod
is gray, none is excluded (see :meth:`services.picker.state.PodTable.fresh_views`).

Approximations: a finished request ends the oldest one counted at that pod (requests are not
told apart), which can only make ages look younger, never older. A client that reads a finished
response slowly keeps its request in flight after the pod stopped counting it; that alone
excludes a pod only for the first cool-off, since its next request, on probation, succeeds. A
sampled request's ext_proc stream ends when its response starts (Envoy closes the stream after
the last message it expects), so such a request counts as in flight (here and in
``lig_picker_in_flight_requests``) until its response starts rather than until it ends.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Callable, Sequence

from scheduling.types import PodView
from shared.logs import RateLimitedLog

log = logging.getLogger("lig.picker.gray_pods")

OUTCOME_WINDOW = 10  # recent response statuses kept per pod
MIN_OUTCOMES = 3  # fewer outcomes than this never make a pod gray
FAILURE_RATIO = 0.5  # share of 5xx among the recent outcomes that makes a pod gray
BASE_COOL_OFF = 5.0  # seconds a pod is excluded the first time
MAX_COOL_OFF = 60.0  # longest exclusion, after repeated offences


class _Pod:
    """What the picker observed of one pod's requests."""

    __slots__ = ("excluded_until", "failures", "offences", "outcomes", "probation", "starts")

    def __init__(self) -> None:
        self.starts: deque[float] = deque()  # in-flight requests' start times, oldest first
        self.outcomes: deque[bool] = deque(maxlen=OUTCOME_WINDOW)  # True: a 5xx
        self.failures = 0  # 5xx among ``outcomes``
        self.excluded_until = 0.0
        self.offences = 0
        self.probation = False


class GrayPods:
    """Per pod, requests in flight and recent outcomes; which pods to leave out right now.

    ``gray_after`` 0 disables the in-flight check; ``sample_every`` 0 disables outcome sampling
    (the picker then never asks Envoy for response headers). ``on_exclude(pod, reason)`` is
    called for every exclusion, ``reason`` being ``unfinished`` or ``5xx``.
    """

    def __init__(self, gray_after: float = 2.0, sample_every: int = 4,
                 on_exclude: Callable[[str, str], None] = lambda pod, reason: None) -> None:
        self.gray_after = gray_after
        self.sample_every = sample_every
        self._on_exclude = on_exclude
        self._pods: dict[str, _Pod] = {}
        self._suspects: set[str] = set()  # excluded or on probation
        self._sampled = 0
        self._log = RateLimitedLog(log)

    def _pod(self, name: str) -> _Pod:
        pod = self._pods.get(name)
        if pod is None:
            pod = self._pods[name] = _Pod()
        return pod

    # --- events ----------------------------------------------------------------------------

    def started(self, name: str, now: float) -> None:
        """A request was routed to pod ``name``."""
        self._pod(name).starts.append(now)

    def finished(self, name: str) -> None:
        """A request to pod ``name`` ended (its ext_proc stream closed)."""
        pod = self._pods.get(name)
        if pod is not None and pod.starts:
            pod.starts.popleft()

    def wants_outcome(self, now: float) -> bool:
        """Whether the next request should report its response status: one in
        ``sample_every``, and every one while a pod on probation may get it (a probe)."""
        for name in self._suspects:
            pod = self._pods[name]
            if pod.excluded_until <= now and not pod.starts:
                return True
        if not self.sample_every:
            return False
        self._sampled += 1
        if self._sampled >= self.sample_every:
            self._sampled = 0
            return True
        return False

    def responded(self, name: str, status: int, now: float) -> None:
        """Pod ``name`` (or Envoy on its behalf) answered a request with ``status``."""
        pod = self._pod(name)
        failed = status >= 500
        if len(pod.outcomes) == OUTCOME_WINDOW and pod.outcomes[0]:
            pod.failures -= 1
        pod.outcomes.append(failed)
        pod.failures += failed
        if not failed:
            if pod.probation and pod.excluded_until <= now:
                pod.probation = False
                pod.offences = 0
                self._suspects.discard(name)
                log.info("pod %s answers again; no longer excluded", name)
            return
        if pod.excluded_until > now:
            return
        enough = len(pod.outcomes) >= MIN_OUTCOMES
        if pod.probation or (enough and pod.failures >= FAILURE_RATIO * len(pod.outcomes)):
            self._exclude(name, pod, now, "5xx", f"{pod.failures} of its last "
                          f"{len(pod.outcomes)} responses were 5xx")

    # --- the decision ----------------------------------------------------------------------

    def excluded(self, views: Sequence[PodView], now: float,
                 arrivals: Sequence[float] | None = None) -> set[str]:
        """The pods among ``views`` (as their snapshots report them) to leave out now;
        ``arrivals[i]`` is when the snapshot of ``views[i]`` arrived (None: all just now)."""
        if not self._pods:
            return set()
        out: set[str] = set()
        for index, view in enumerate(views):
            oldest = (now if arrivals is None else arrivals[index]) - self.gray_after
            pod = self._pods.get(view.name)
            if pod is None:
                continue
            if pod.excluded_until > now or (pod.probation and pod.starts):
                out.add(view.name)
                continue
            starts = pod.starts
            if not self.gray_after or not starts or starts[0] > oldest:
                continue
            # Start times are in time order: count the old ones by bisection, not one by one
            # (a pod can have thousands in flight, long streams older than gray_after among them).
            old = bisect.bisect_right(starts, oldest)
            if old > view.running + view.waiting:
                self._exclude(view.name, pod, now, "unfinished",
                              f"{old} requests in flight for over {self.gray_after:g}s while it "
                              f"reports {view.running} running and {view.waiting} waiting")
                out.add(view.name)
        return out

    def _exclude(self, name: str, pod: _Pod, now: float, reason: str, why: str) -> None:
        pod.offences += 1
        cool_off = min(MAX_COOL_OFF, BASE_COOL_OFF * 2 ** (pod.offences - 1))
        pod.excluded_until = now + cool_off
        pod.probation = True
        pod.outcomes.clear()
        pod.failures = 0
        self._suspects.add(name)
        self._on_exclude(name, reason)
        self._log.warning("pod %s looks gray (%s); excluded for %gs, then on probation",
                          name, why, cool_off)

    def forget(self, members: set[str]) -> None:
        """Drop what is known of pods no longer in ``members``."""
        for name in [name for name in self._pods if name not in members]:
            del self._pods[name]
            self._suspects.discard(name)
