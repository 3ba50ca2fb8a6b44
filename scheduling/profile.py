"""Scheduler profiles: filters -> weighted scorers -> picker, composed from data.

As the Gateway API Inference Extension's ``SchedulerProfile``: each filter narrows the candidates
in turn; every scorer rates the survivors (0..1 for the scorers shipped here), each score times
the scorer's weight adds to a pod's total; the pods with the highest total go to the picker (ties
broken by it, uniformly at random by default). A filter that keeps no pod (or raises
:class:`FilterFailed`) passes its own input on, as the filter tree's failure branch, except when
it sheds the request (:class:`ShedRequest`: the picker answers 429). So a profile sheds only
through a filter that sheds, and ``sheddable_gate`` sheds only Sheddable requests.

``prefix-aware`` is such a profile, with :data:`PREFIX_AWARE` as the defaults of its params: a
pool's ``scheduling.params`` may replace ``filters``, ``scorers`` (with their weights and params)
and ``picker``, so the whole composition is configuration (docs/scheduling.md).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from operator import mul
from typing import Annotated, Any

import msgspec

from scheduling.catalog import create_plugin
from scheduling.params import PolicyConfigError, parse_params
from scheduling.plugin import Filter, FilterFailed, Picker, Scorer, ShedRequest
from scheduling.types import Decision, PodScore, PodView, SchedulingRequest, StepTrace


class FilterSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A filter of a profile: its plugin type and params."""

    plugin: str
    params: dict[str, Any] = {}


class ScorerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A scorer of a profile: its plugin type, weight and params."""

    plugin: str
    weight: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    params: dict[str, Any] = {}


class ProfileParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A profile as data; the defaults are the ``prefix-aware`` policy.

    Pods whose weighted total is within ``tie_margin + stale_margin * age`` (at most
    ``max_margin``) of the best are near-ties, all handed to the picker: ``age`` is the
    candidates' mean snapshot age plus the peers' lag (seconds), so the less the scores can be
    trusted, the more pods count as equal. The bound keeps a pod whose metrics stopped (up to
    ``--stale-after`` old, 3 s by default) from making every pod a near-tie of every other.
    """

    filters: tuple[FilterSpec, ...] = (
        FilterSpec("sheddable_gate", {"queue_threshold": 5, "kv_cache_threshold": 0.8}),
    )
    scorers: tuple[ScorerSpec, ...] = (
        ScorerSpec("prefix_affinity", 2.0, {"load_margin": 8}),
        ScorerSpec("token_load", 1.0, {"token_scale": 4096, "recent": True}),
        ScorerSpec("queue_load", 1.0, {"stale_span": 100.0, "max_span": 25.0}),
        ScorerSpec("kv_cache_load", 1.0),
        ScorerSpec("lora_fit", 3.25),
    )
    picker: str = "least_work"
    picker_params: dict[str, Any] = {}
    tie_margin: Annotated[float, msgspec.Meta(ge=0.0)] = 0.1
    stale_margin: Annotated[float, msgspec.Meta(ge=0.0)] = 2.0
    max_margin: Annotated[float, msgspec.Meta(ge=0.0)] = 0.5


PREFIX_AWARE = ProfileParams()
_TIE = 1e-9  # totals this close to the best are ties (float sums of equal scores can differ)


class ProfilePolicy:
    """A built profile: filters, (scorer, weight, name) triples, and the picker."""

    def __init__(self, name: str, filters: Sequence[tuple[str, Filter]],
                 scorers: Sequence[tuple[str, float, Scorer]], picker: Picker,
                 picker_name: str, tie_margin: float = 0.0, stale_margin: float = 0.0,
                 max_margin: float = 0.0) -> None:
        self.name = name
        self._filters = tuple(filters)
        self._scorers = tuple(scorers)
        self._scorer_list = tuple(scorer for _, _, scorer in scorers)
        self._weights = tuple(weight for _, weight, _ in scorers)
        self._pick = picker.pick
        self._picker_name = picker_name
        self._tie_margin = tie_margin
        self._stale_margin = stale_margin
        self._max_margin = max(max_margin, tie_margin)

    def schedule(self, request: SchedulingRequest, pods: Sequence[PodView], *,
                 explain: bool = False) -> Decision:
        """Filter ``pods``, score the survivors, pick among the best-scored."""
        if not pods:
            return Decision(pick=None, candidates=())
        trace: list[StepTrace] | None = [] if explain else None
        for name, step in self._filters:
            try:
                kept = step.filter(request, pods)
            except ShedRequest:
                if trace is not None:
                    trace.append(StepTrace(name, _names(pods), (), "shed"))
                return Decision(pick=None, candidates=(), shed=True, steps=tuple(trace or ()))
            except FilterFailed:
                kept = ()
            if trace is not None:
                trace.append(StepTrace(name, _names(pods), _names(kept),
                                       "next" if kept else "passed input on"))
            if kept:
                pods = kept
        columns = [scorer.score(request, pods) for scorer in self._scorer_list]
        weights = self._weights
        # One pass per pod over the transposed columns: cheaper than one pass per scorer.
        totals = [sum(map(mul, weights, row)) for row in zip(*columns, strict=True)]
        best = max(totals) - self.margin(pods)
        kept = [pod for pod, total in zip(pods, totals, strict=True) if total >= best]
        pick = self._pick(request, kept)
        if trace is None:
            return Decision(pick=pick, candidates=tuple(kept))
        trace.append(StepTrace("weighted scores", _names(pods), _names(kept), "next"))
        trace.append(StepTrace(self._picker_name, _names(kept), (pick.name,), "done"))
        scored = tuple(
            PodScore(pod.name, totals[index],
                     {name: column[index] for (name, _, _), column in zip(
                         self._scorers, columns, strict=True)})
            for index, pod in enumerate(pods))
        return Decision(pick=pick, candidates=tuple(kept), steps=tuple(trace), scores=scored)

    def margin(self, pods: Sequence[PodView]) -> float:
        """How far below the best total a pod still counts as tied: the tie margin, plus the
        stale margin per second of the candidates' mean snapshot age and the peers' lag.

        Why it grows with age: scores computed from a snapshot of age ``a`` can be off by what
        arrived and ended in ``a``; pods apart by less are equal as far as the picker knows, and
        a greedy choice between them herds every decision of the window (and every replica's)
        onto the same pod (docs/scheduling.md, "Near-ties, stale state and replicas")."""
        margin = self._tie_margin
        if self._stale_margin:
            age = sum([pod.age for pod in pods]) / len(pods) + pods[0].peer_lag
            margin = min(margin + self._stale_margin * age, self._max_margin)
        return max(margin, _TIE)


def build_profile(name: str, params: Mapping[str, Any], rng: random.Random) -> ProfilePolicy:
    """Build the profile policy ``name`` from ``params`` (:class:`ProfileParams`)."""
    owner = f"policy {name!r}"
    p = parse_params(params, ProfileParams, owner)
    filters: list[tuple[str, Filter]] = []
    for filter_spec in p.filters:
        entry, plugin = create_plugin(filter_spec.plugin, filter_spec.params, rng)
        if entry.kind != "filter" or not isinstance(plugin, Filter):
            raise PolicyConfigError(
                f"{owner}: filters: {filter_spec.plugin!r} is a {entry.kind}")
        filters.append((filter_spec.plugin, plugin))
    scorers: list[tuple[str, float, Scorer]] = []
    for scorer_spec in p.scorers:
        entry, plugin = create_plugin(scorer_spec.plugin, scorer_spec.params, rng)
        if entry.kind != "scorer" or not isinstance(plugin, Scorer):
            raise PolicyConfigError(
                f"{owner}: scorers: {scorer_spec.plugin!r} is a {entry.kind}")
        scorers.append((scorer_spec.plugin, scorer_spec.weight, plugin))
    if not scorers:
        raise PolicyConfigError(f"{owner}: scorers: at least one scorer is needed")
    entry, picker = create_plugin(p.picker, p.picker_params, rng)
    if entry.kind != "picker" or not isinstance(picker, Picker):
        raise PolicyConfigError(f"{owner}: picker: {p.picker!r} is a {entry.kind}")
    return ProfilePolicy(name, filters, scorers, picker, f"{p.picker} pick", p.tie_margin,
                         p.stale_margin, p.max_margin)


def _names(pods: Sequence[PodView]) -> tuple[str, ...]:
    return tuple(pod.name for pod in pods)
