"""``round_robin``: pick candidates in turn (a stateful baseline; one cursor per policy)."""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.plugin import PluginRecord
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


PLUGIN = PluginRecord("round_robin", "picker", RoundRobinPicker)
