"""``sheddable_gate``: the filter tree's shedding rule for scorer pipelines.

Critical and Standard requests pass untouched (they are never shed). A Sheddable request keeps
only the pods with room for it (``waiting <= queue_threshold`` and ``kv_cache_usage <=
kv_cache_threshold``, upstream's thresholds, as ``sheddable_capacity``); with none, it is shed
(the picker answers 429).
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.plugin import PluginRecord, ShedRequest
from scheduling.plugins.sheddable_capacity import SheddableCapacity, SheddableCapacityParams
from scheduling.types import PodView, SchedulingRequest
from shared.schemas import Criticality


class SheddableGate:
    """Pass non-sheddable requests; keep pods with capacity for sheddable ones, else shed."""

    __slots__ = ("_capacity",)

    def __init__(self, queue_threshold: int, kv_cache_threshold: float) -> None:
        self._capacity = SheddableCapacity(queue_threshold, kv_cache_threshold)

    def filter(self, request: SchedulingRequest, pods: Sequence[PodView]) -> Sequence[PodView]:
        """``pods`` for a non-sheddable request; the pods with capacity for a sheddable one."""
        if request.criticality is not Criticality.SHEDDABLE:
            return pods
        kept = self._capacity.filter(request, pods)
        if not kept:
            raise ShedRequest("no pod has capacity for a sheddable request")
        return kept


PLUGIN = PluginRecord("sheddable_gate", "filter", SheddableGate, SheddableCapacityParams)
