"""``least_queue``: keep pods in the lowest band of waiting-queue sizes (upstream's
``leastQueuingFilterFunc``).

The band is ``[min, min + (max - min) // n]`` with ``n`` the number of input pods, in integer
arithmetic as upstream. Considering every pod in the low band rather than only the minimum gives
the next step more choice, which upstream found better on aggregate.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.plugin import PluginRecord
from scheduling.types import PodView, SchedulingRequest


class LeastQueue:
    """Keep pods whose waiting queue lies in the first ``(max - min) / n`` band."""

    __slots__ = ()

    def filter(self, request: SchedulingRequest, pods: Sequence[PodView]) -> Sequence[PodView]:
        """Keep the low-queue band, in input order (empty input gives an empty result)."""
        if not pods:
            return []
        waiting = [pod.waiting for pod in pods]
        low = min(waiting)
        high = low + (max(waiting) - low) // len(pods)
        return [pod for pod in pods if low <= pod.waiting <= high]


PLUGIN = PluginRecord("least_queue", "filter", LeastQueue)
