"""``kv_cache_load``: prefer pods with more free KV cache: score ``1 - kv_cache_usage``."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from scheduling.plugin import no_params
from scheduling.types import PodView, SchedulingRequest


class KvCacheLoad:
    """Score the free fraction of the KV cache (0..1)."""

    __slots__ = ()

    def score(self, request: SchedulingRequest, pods: Sequence[PodView]) -> list[float]:
        """One score per pod, 0..1 (usage outside 0..1 is clamped)."""
        usages = [pod.kv_cache_usage for pod in pods]
        return [(1.0 - usage if usage < 1.0 else 0.0) if usage > 0.0 else 1.0 for usage in usages]


def create(params: Mapping[str, Any], rng: random.Random) -> KvCacheLoad:
    """Build the scorer (it takes no parameters)."""
    no_params(params, "kv_cache_load")
    return KvCacheLoad()
