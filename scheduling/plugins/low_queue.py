"""``low_queue``: keep pods whose waiting queue is below a threshold (upstream's
``lowQueueingPodPredicate``; the filter tree uses ``queueing_threshold_lora``, default 50)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec

from scheduling.plugin import PluginRecord
from scheduling.types import PodView, SchedulingRequest


class LowQueueParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``threshold``: a pod is kept when ``waiting < threshold``."""

    threshold: Annotated[int, msgspec.Meta(ge=0)] = 50


class LowQueue:
    """Keep pods with ``waiting < threshold``."""

    __slots__ = ("_threshold",)

    def __init__(self, threshold: int) -> None:
        self._threshold = threshold

    def filter(self, request: SchedulingRequest, pods: Sequence[PodView]) -> Sequence[PodView]:
        """Keep the pods under the queue threshold."""
        threshold = self._threshold
        return [pod for pod in pods if pod.waiting < threshold]


PLUGIN = PluginRecord("low_queue", "filter", LowQueue, LowQueueParams)
