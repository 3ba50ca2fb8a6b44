"""``queue_load``: prefer shorter waiting queues, scaled between the candidates' extremes.

Score ``(max - waiting) / (max - min)`` over the candidates (1 for the shortest queue, 0 for the
longest, 1 for all when they are equal), as the Inference Extension's queue scorer.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.plugin import PluginRecord
from scheduling.types import PodView, SchedulingRequest


class QueueLoad:
    """Score the waiting queue, min-max scaled to 0..1 (shorter is better)."""

    __slots__ = ()

    def score(self, request: SchedulingRequest, pods: Sequence[PodView]) -> list[float]:
        """One score per pod, 0..1."""
        queues = [pod.waiting for pod in pods]
        low, high = min(queues), max(queues)
        if high == low:
            return [1.0] * len(pods)
        span = float(high - low)
        return [(high - queue) / span for queue in queues]


PLUGIN = PluginRecord("queue_load", "scorer", QueueLoad)
