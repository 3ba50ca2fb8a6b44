"""``least_kv_cache``: keep pods in the lowest band of KV-cache usage (upstream's
``leastKVCacheFilterFunc``): ``[min, min + (max - min) / n]`` in float arithmetic.

NaN usages are left out of the bounds and never kept, which is what upstream's comparisons do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from scheduling.plugin import PluginRecord
from scheduling.types import PodView, SchedulingRequest


class LeastKvCache:
    """Keep pods whose KV-cache usage lies in the first ``(max - min) / n`` band."""

    __slots__ = ()

    def filter(self, request: SchedulingRequest, pods: Sequence[PodView]) -> Sequence[PodView]:
        """Keep the low-usage band, in input order (empty input gives an empty result)."""
        if not pods:
            return []
        usage = [pod.kv_cache_usage for pod in pods]
        if math.isnan(sum(usage)):
            # Rare: a NaN (or +Inf and -Inf together) would make min()/max() order-dependent.
            usage = [value for value in usage if not math.isnan(value)]
            if not usage:
                return []
        low = min(usage)
        high = low + (max(usage) - low) / len(pods)
        return [pod for pod in pods if low <= pod.kv_cache_usage <= high]


PLUGIN = PluginRecord("least_kv_cache", "filter", LeastKvCache)
