"""``round_robin``: pick candidates in turn (a stateful baseline; one cursor per policy)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from scheduling.plugin import no_params
from scheduling.types import PodView, SchedulingRequest


class RoundRobinPicker:
    """Pick ``pods[cursor % len(pods)]`` and advance the cursor."""

    __slots__ = ("_cursor",)

    def __init__(self) -> None:
        self._cursor = 0

    def pick(self, request: SchedulingRequest, pods: Sequence[PodView]) -> PodView:
        """Return the next pod in turn."""
        pod = pods[self._cursor % len(pods)]
        self._cursor += 1
        return pod


def create(params: Mapping[str, Any], rng: random.Random) -> RoundRobinPicker:
    """Build the picker (it takes no parameters)."""
    no_params(params, "round_robin")
    return RoundRobinPicker()
