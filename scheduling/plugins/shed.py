"""``shed``: drop the request (upstream's "drop request" step; the picker answers 429)."""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.plugin import PluginRecord, ShedRequest
from scheduling.types import PodView, SchedulingRequest


class Shed:
    """Always fail with :class:`ShedRequest`."""

    __slots__ = ()

    def filter(self, request: SchedulingRequest, pods: Sequence[PodView]) -> Sequence[PodView]:
        """Refuse the request."""
        raise ShedRequest("dropping request due to limited backend resources")


PLUGIN = PluginRecord("shed", "filter", Shed)
