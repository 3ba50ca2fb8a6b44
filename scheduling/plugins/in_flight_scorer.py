"""``in_flight``: score pods by this picker's requests in flight to them, fewer is better.

In-flight counts react to this picker's own decisions immediately, while scraped metrics lag by
a scrape interval; used as a tie-break they spread bursts that arrive between two scrapes.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.plugin import PluginRecord
from scheduling.types import PodView, SchedulingRequest


class InFlightScorer:
    """Score ``-in_flight``."""

    __slots__ = ()

    def score(self, request: SchedulingRequest, pods: Sequence[PodView]) -> list[float]:
        """One score per pod: the negated in-flight count."""
        return [-pod.in_flight for pod in pods]


PLUGIN = PluginRecord("in_flight", "scorer", InFlightScorer)
