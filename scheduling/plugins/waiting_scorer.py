"""``waiting``: score pods by their waiting queue, shorter is better (score ``-waiting``)."""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.plugin import PluginRecord
from scheduling.types import PodView, SchedulingRequest


class WaitingScorer:
    """Score ``-waiting``."""

    __slots__ = ()

    def score(self, request: SchedulingRequest, pods: Sequence[PodView]) -> list[float]:
        """One score per pod: the negated waiting-queue size."""
        return [-pod.waiting for pod in pods]


PLUGIN = PluginRecord("waiting", "scorer", WaitingScorer)
