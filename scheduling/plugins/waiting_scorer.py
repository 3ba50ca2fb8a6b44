"""``waiting``: score pods by their waiting queue, shorter is better (score ``-waiting``)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from scheduling.plugin import no_params
from scheduling.types import PodView, SchedulingRequest


class WaitingScorer:
    """Score ``-waiting``."""

    __slots__ = ()

    def score(self, request: SchedulingRequest, pods: Sequence[PodView]) -> list[float]:
        """One score per pod: the negated waiting-queue size."""
        return [-pod.waiting for pod in pods]


def create(params: Mapping[str, Any], rng: random.Random) -> WaitingScorer:
    """Build the scorer (it takes no parameters)."""
    no_params(params, "waiting")
    return WaitingScorer()
