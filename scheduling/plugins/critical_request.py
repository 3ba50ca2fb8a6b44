"""``critical_request``: keep every pod unless the request is Sheddable (upstream's root step).

Upstream's request has a boolean ``Critical``; here Critical and Standard both count as critical,
so only Sheddable requests fail this step and take the sheddable branch.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.plugin import PluginRecord
from scheduling.types import PodView, SchedulingRequest
from shared.schemas import Criticality


class CriticalRequest:
    """Pass all pods through for Critical and Standard requests, none for Sheddable ones."""

    __slots__ = ()

    def filter(self, request: SchedulingRequest, pods: Sequence[PodView]) -> Sequence[PodView]:
        """Keep ``pods`` as they are, or nothing for a sheddable request."""
        return () if request.criticality is Criticality.SHEDDABLE else pods


PLUGIN = PluginRecord("critical_request", "filter", CriticalRequest)
