"""The picker's estimate of the load its pods have not reported yet.

Between two scrapes of a pod (50 ms by default) every decision sees the same snapshot, so a
policy that keeps the pods with the least queue or KV usage sends every request of that window to
the same one or two pods (herding). The picker knows what it sent: per pod, the requests it routed
there since the pod's newest snapshot arrived. The count restarts when a newer snapshot of the pod
arrives, which shows those requests (waiting or running).

A policy sees each pod's ``waiting`` raised by its count *minus the smallest count among the
pods*: only what a pod got beyond the least-served one. The queue bands of the filter tree rank
pods relative to the lowest queue, so they see the full correction; but requests spread evenly
over every pod are mostly running, not waiting, and counting them all as queue would lift the
whole pool over the tree's absolute thresholds (a sheddable request needs a pod with
``waiting <= 5``), shedding below capacity when scrapes are slow.

Snapshots are reconciled by time: a snapshot clears only the requests routed *before its scrape
began* (the collector stamps each snapshot with its scrape's start); requests routed after it,
by this picker or a peer, stay counted, since the pod's page may not show them. Clearing every
count when a snapshot *arrived* forgot the requests routed during the scrape and its delivery
(scrape duration plus the NATS hop, 5 ms of a 50 ms interval; with 4 replicas a peer's request
routed before the arrival but applied after it was counted again), so the pod just reported
looked the least loaded of all and the next decisions of every replica herded onto it
(issue 24). The scrape's start is read on this picker's clock as the snapshot's arrival minus
its age (the wall clocks' difference; 0 when that is negative or beyond ``stale_after``): with
skewed clocks the estimate degrades to clearing at arrival, the behaviour before.

Prompt tokens are counted beside the requests and shown to
policies as ``PodView.unreported_tokens``, in full, not relative to the least-loaded pod: the
``token_load`` scorer rates them on an absolute scale. KV usage itself is not corrected.

The tokens counted are those the pod will have to *prefill* (:func:`prefill_tokens`): the prompt's
estimate (``scheduling/prompt.py``) minus the leading blocks the pod holds according to the prefix
index the decision used (precise hits when the pool has them, else approximate). Counting whole
prompts made the pod holding a popular prefix look loaded by the very requests that hit its
cache, so the next request of that prefix went elsewhere and missed (docs/benchmarks.md, "Prefix
sources"). Peers' routed events carry the same figure (docs/decision-stream.md).

This corrects the policies' input, not the policies: ``lig picker --no-load-estimate`` turns it
off, leaving decisions on the scraped metrics alone, as upstream.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence

import msgspec

from scheduling.types import PodView


def prefill_tokens(prompt_tokens: int, hits: int, blocks: int, block_tokens: int) -> int:
    """The tokens of a prompt of ``prompt_tokens`` (estimated) that a pod holding ``hits`` of
    its ``blocks`` leading blocks looked up still has to compute.

    The cached part is the hit fraction of the prompt, ``prompt_tokens * hits / blocks``, but at
    most ``hits * block_tokens`` (the most tokens a block holds): the blocks looked up may cover
    only the start of a prompt (lookups are capped, a batch hashes its first prompt only), and a
    pod never holds the partial last block."""
    if hits <= 0 or blocks <= 0:
        return prompt_tokens
    return prompt_tokens - min(prompt_tokens * hits // blocks, hits * block_tokens)


_ANY_TOKENS = float("inf")  # sorts after every (time, tokens) entry of the same time


class UnreportedLoad:
    """Per pod, the requests and prompt tokens routed there that its newest snapshot does not
    show: those routed after that snapshot's scrape began (always none when disabled).

    Each request is kept with the time it was routed (on the picker's clock), so that a
    snapshot clears only those its scrape could have seen (:meth:`reported`).
    """

    __slots__ = ("_counts", "_routed", "_tokens", "enabled")

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._counts: dict[str, int] = {}
        self._tokens: dict[str, int] = {}
        # Per pod, (routed at, tokens) in time order: a peer's request is applied a decision
        # delay after it was routed, so it is inserted, not appended.
        self._routed: dict[str, list[tuple[float, int]]] = {}

    def routed(self, pod: str, tokens: int = 0, at: float = 0.0) -> None:
        """A request with ``tokens`` estimated prompt tokens was sent to ``pod`` at ``at``."""
        if not self.enabled:
            return
        self._counts[pod] = self._counts.get(pod, 0) + 1
        if tokens > 0:
            self._tokens[pod] = self._tokens.get(pod, 0) + tokens
        entries = self._routed.get(pod)
        if entries is None:
            self._routed[pod] = [(at, tokens)]
        elif at >= entries[-1][0]:
            entries.append((at, tokens))
        else:
            bisect.insort(entries, (at, tokens))

    def unrouted(self, pod: str, tokens: int = 0) -> None:
        """A request counted for ``pod`` went elsewhere after all (a gateway fallback)."""
        entries = self._routed.get(pod)
        if not entries:
            return
        # The newest entry with these tokens (the fallback follows its routing closely).
        for index in range(len(entries) - 1, -1, -1):
            if entries[index][1] == tokens:
                del entries[index]
                break
        else:
            tokens = entries.pop()[1]
        self._settle(pod, entries, 1, max(0, tokens))

    def reported(self, pod: str, scrape_began: float | None = None) -> None:
        """A newer snapshot of ``pod`` arrived, whose scrape began at ``scrape_began`` (None:
        now, clearing everything): it shows the requests routed until then."""
        entries = self._routed.get(pod)
        if not entries:
            return
        if scrape_began is None or entries[-1][0] <= scrape_began:
            self._routed.pop(pod, None)
            self._counts.pop(pod, None)
            self._tokens.pop(pod, None)
            return
        seen = bisect.bisect_right(entries, (scrape_began, _ANY_TOKENS))
        if seen:
            tokens = sum(entry[1] for entry in entries[:seen])
            del entries[:seen]
            self._settle(pod, entries, seen, tokens)

    def _settle(self, pod: str, entries: list[tuple[float, int]], requests: int,
                tokens: int) -> None:
        """``requests`` requests with ``tokens`` tokens of ``pod`` left ``entries``."""
        if not entries:
            self._routed.pop(pod, None)
            self._counts.pop(pod, None)
            self._tokens.pop(pod, None)
            return
        self._counts[pod] = len(entries)
        left = self._tokens.get(pod, 0) - tokens
        if left > 0:
            self._tokens[pod] = left
        else:
            self._tokens.pop(pod, None)

    @property
    def counts(self) -> Mapping[str, int]:
        """Requests per pod that its newest snapshot does not show (pods with none absent)."""
        return self._counts

    @property
    def tokens(self) -> Mapping[str, int]:
        """Prompt tokens per pod that its newest snapshot does not show (pods with none absent)."""
        return self._tokens


RECENT_TAU = 0.05
"""Seconds in which a routed prompt's weight in :class:`RecentWork` falls to 1/e: about two
prefills of a typical prompt (a pod of the default simulator profile prefills 1,000 tokens in
about 25 ms), so a prompt counts while it may still be ahead of a new request. Chosen by that
reasoning, not tuned: other values are untried (issue 24)."""


class RecentWork:
    """Per pod, the prefill tokens routed there (own and peers'), each weighing
    ``exp(-age / tau)``: what the pod probably still has to prefill before a new request.

    Unlike the unreported tokens it does not restart with a snapshot, so it compares pods whose
    snapshots differ in age: counting since each snapshot makes the pod reported last look the
    least loaded, and every decision until the next snapshot herds onto it (issue 24).
    """

    __slots__ = ("_decay", "_work", "enabled")

    def __init__(self, enabled: bool = True, tau: float = RECENT_TAU) -> None:
        self.enabled = enabled
        self._decay = 1.0 / tau
        self._work: dict[str, tuple[float, float]] = {}  # pod -> (tokens, as of when)

    def routed(self, pod: str, tokens: int, at: float) -> None:
        """``tokens`` to prefill were routed to ``pod`` at ``at`` (a peer's: in the past)."""
        if not self.enabled or tokens <= 0:
            return
        current = self._work.get(pod)
        if current is None:
            self._work[pod] = (float(tokens), at)
            return
        work, when = current
        if at >= when:
            self._work[pod] = (work * math.exp((when - at) * self._decay) + tokens, at)
        else:  # a peer's request, routed before our last update
            self._work[pod] = (work + tokens * math.exp((at - when) * self._decay), when)

    def at(self, now: float) -> dict[str, float]:
        """Each pod's recent work as of ``now`` (pods with none absent)."""
        decay = self._decay
        return {pod: work * math.exp((when - now) * decay)
                for pod, (work, when) in self._work.items()}


def picker_views(
    views: Sequence[PodView], in_flight: Mapping[str, int], unreported: Mapping[str, int],
    unreported_tokens: Mapping[str, int] | None = None, ages: Sequence[float] | None = None,
    peer_lag: float = 0.0, recent: Mapping[str, float] | None = None, peer_unseen: float = 0.0,
) -> list[PodView]:
    """``views`` as a policy sees them: with this picker's in-flight counts, ``waiting`` raised
    by each pod's unreported requests beyond the fewest any of ``views`` has, each pod's
    unreported prompt tokens (in full: token scorers compare pods on their own scale), and,
    when given, each view's snapshot age (``ages``, in ``views`` order), the peers' lag and
    unseen decisions, and each pod's recent work (``recent``, :class:`RecentWork`)."""
    tokens = unreported_tokens or {}
    recent = recent or {}
    if not views or (not in_flight and not unreported and not tokens and ages is None
                     and not peer_lag and not recent and not peer_unseen):
        return list(views)
    # Counts are positive: with fewer counted pods than views, some view has none.
    if len(unreported) < len(views):
        fewest = 0
    else:
        fewest = min([unreported.get(view.name, 0) for view in views])
    replace = msgspec.structs.replace
    result = []
    for index, view in enumerate(views):
        name = view.name
        requests = in_flight.get(name, 0)
        extra = unreported.get(name, 0) - fewest
        routed_tokens = tokens.get(name, 0)
        age = ages[index] if ages is not None else view.age
        work = recent.get(name, 0.0)
        if requests or extra or routed_tokens or age or peer_lag or work or peer_unseen:
            view = replace(view, waiting=view.waiting + extra, in_flight=requests,
                           unreported_tokens=routed_tokens, age=age, peer_lag=peer_lag,
                           recent_tokens=work, peer_unseen=peer_unseen,
                           waiting_estimated=extra)
        result.append(view)
    return result
