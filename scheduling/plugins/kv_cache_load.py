"""``kv_cache_load``: prefer pods with more free KV cache: score ``1 - kv_cache_usage``."""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.plugin import PluginRecord
from scheduling.types import PodView, SchedulingRequest


class KvCacheLoad:
    """Score the free fraction of the KV cache (0..1)."""

    __slots__ = ()

    def score(self, request: SchedulingRequest, pods: Sequence[PodView]) -> list[float]:
        """One score per pod, 0..1 (usage outside 0..1 is clamped)."""
        usages = [pod.kv_cache_usage for pod in pods]
        return [(1.0 - usage if usage < 1.0 else 0.0) if usage > 0.0 else 1.0 for usage in usages]


PLUGIN = PluginRecord("kv_cache_load", "scorer", KvCacheLoad)
