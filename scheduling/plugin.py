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


class FilterFailed(Exception):
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
PluginFactory = Callable[[Mapping[str, Any], random.Random], Filter | Scorer | Picker]


class PluginType(msgspec.Struct, frozen=True):
    """A registry entry: what kind of plugin a type name builds, and its factory."""

    kind: PluginKind
    factory: PluginFactory


class NoParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Parameters of a plugin that takes none."""


def no_params(params: Mapping[str, Any], plugin: str) -> None:
    """Reject any parameter given to a plugin that takes none."""
    parse_params(params, NoParams, f"plugin {plugin!r}")


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
