"""The plugin framework: small Filter, Scorer and Picker protocols over a list of pod views.

A *filter* narrows the candidates (an empty result, or raising :class:`FilterFailed`, counts as
failure and the decision tree passes the step's own input on). A *scorer* rates every candidate
(higher is better); in a tree it acts as the filter "keep the best-scored pods". A *picker*
chooses the final pod among the survivors.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

from scheduling.params import parse_params
from scheduling.types import PodView, SchedulingRequest
from shared.errors import LigError


class FilterFailed(LigError):
    """Raised by a filter that cannot produce candidates (the tree takes ``on_failure``)."""


class ShedRequest(FilterFailed):
    """Raised by a filter that decides to drop the request (the picker answers 429)."""


# Runtime-checkable: building a policy checks each plugin against its registered kind.
@runtime_checkable
class Filter(Protocol):
    """Narrows the candidate list; must keep input order and never mutate its input."""

    def filter(self, request: SchedulingRequest, pods: Sequence[PodView]) -> Sequence[PodView]:
        """Return the pods to keep (may be ``pods`` itself); empty means failure."""
        ...


@runtime_checkable
class Scorer(Protocol):
    """Rates every candidate; higher is better."""

    def score(self, request: SchedulingRequest, pods: Sequence[PodView]) -> list[float]:
        """Return one score per pod, in input order."""
        ...


@runtime_checkable
class Picker(Protocol):
    """Chooses the final pod among non-empty candidates."""

    def pick(self, request: SchedulingRequest, pods: Sequence[PodView]) -> PodView:
        """Return one of ``pods``."""
        ...


PluginKind = Literal["filter", "scorer", "picker"]


class NoParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Parameters of a plugin that takes none."""


class PluginRecord(msgspec.Struct, frozen=True):
    """How to build one plugin type: each plugin module declares one, the catalog lists them.

    ``constructor`` is called with the fields of the parsed ``params`` Struct as keyword
    arguments, plus ``rng=`` (the policy's random source) when ``takes_rng`` is set.
    """

    name: str
    kind: PluginKind
    constructor: Callable[..., Filter | Scorer | Picker]
    params: type[msgspec.Struct] = NoParams
    takes_rng: bool = False

    def build(self, params: Mapping[str, Any], rng: random.Random) -> Filter | Scorer | Picker:
        """Check ``params`` against the params Struct and construct the plugin.

        Raises :class:`~scheduling.params.PolicyConfigError` naming the plugin and the parameter.
        """
        parsed = parse_params(params, self.params, f"plugin {self.name!r}")
        kwargs = msgspec.structs.asdict(parsed)
        if self.takes_rng:
            kwargs["rng"] = rng
        return self.constructor(**kwargs)


class BestScore:
    """A scorer used as a tree step: keep the pods with the highest score (ties all kept)."""

    __slots__ = ("_scorer",)

    def __init__(self, scorer: Scorer) -> None:
        self._scorer = scorer

    def filter(self, request: SchedulingRequest, pods: Sequence[PodView]) -> Sequence[PodView]:
        """Keep the best-scored pods, in input order."""
        if not pods:
            return []
        scores = self._scorer.score(request, pods)
        best = max(scores)
        return [pod for pod, score in zip(pods, scores, strict=True) if score == best]
