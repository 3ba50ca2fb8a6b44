"""``sheddable_capacity``: keep pods with room for a sheddable request without hurting critical
ones (upstream's ``noQueueAndLessThanKVCacheThresholdPredicate``):
``waiting <= queue_threshold`` and ``kv_cache_usage <= kv_cache_threshold``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec

from scheduling.plugin import PluginRecord
from scheduling.types import PodView, SchedulingRequest


class SheddableCapacityParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Upstream defaults: ``queueThresholdCritical`` 5 and ``kvCacheThreshold`` 0.8."""

    queue_threshold: Annotated[int, msgspec.Meta(ge=0)] = 5
    kv_cache_threshold: Annotated[float, msgspec.Meta(ge=0.0)] = 0.8


class SheddableCapacity:
    """Keep pods with a short queue and KV-cache usage under the threshold."""

    __slots__ = ("_kv_cache_threshold", "_queue_threshold")

    def __init__(self, queue_threshold: int, kv_cache_threshold: float) -> None:
        self._queue_threshold = queue_threshold
        self._kv_cache_threshold = kv_cache_threshold

    def filter(self, request: SchedulingRequest, pods: Sequence[PodView]) -> Sequence[PodView]:
        """Keep the pods with spare capacity."""
        queue, kv = self._queue_threshold, self._kv_cache_threshold
        return [pod for pod in pods if pod.waiting <= queue and pod.kv_cache_usage <= kv]


PLUGIN = PluginRecord("sheddable_capacity", "filter", SheddableCapacity, SheddableCapacityParams)
