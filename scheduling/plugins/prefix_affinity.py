"""``prefix_affinity``: prefer pods believed to hold a longer prefix of the prompt, unless busy.

Score: the fraction of the prompt's hashed blocks a pod holds as a leading run
(``SchedulingRequest.prefix_hits`` over ``len(prefix_hashes)``, 0..1). A pod whose ``waiting``
(already raised by the picker's unreported requests, ``services/picker/load_estimate.py``)
exceeds the least-waiting candidate's by more than ``load_margin`` scores 0: the cached prefix
saves prefill, but not a queue's worth of waiting, and without the margin a popular prefix sends
every request to one pod (the hot spot other routers' users report) while its peers idle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec

from scheduling.plugin import PluginRecord
from scheduling.types import PodView, SchedulingRequest


class PrefixAffinityParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``load_margin``: waiting requests a prefix-holding pod may have beyond the least-waiting
    candidate before its prefix stops counting."""

    load_margin: Annotated[int, msgspec.Meta(ge=0)] = 8


class PrefixAffinity:
    """Score the fraction of the prompt's blocks a pod holds, 0 beyond the load margin."""

    __slots__ = ("_margin",)

    def __init__(self, load_margin: int) -> None:
        self._margin = load_margin

    def score(self, request: SchedulingRequest, pods: Sequence[PodView]) -> list[float]:
        """One score per pod, 0..1."""
        hits = request.prefix_hits
        blocks = len(request.prefix_hashes)
        if not hits or not blocks:
            return [0.0] * len(pods)
        ceiling = min([pod.waiting for pod in pods]) + self._margin
        return [hits.get(pod.name, 0) / blocks if pod.waiting <= ceiling else 0.0
                for pod in pods]


PLUGIN = PluginRecord("prefix_affinity", "scorer", PrefixAffinity, PrefixAffinityParams)
