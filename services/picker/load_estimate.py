"""The picker's estimate of the load its pods have not reported yet.

Between two scrapes of a pod (50 ms by default) every decision sees the same snapshot, so a
policy that keeps the pods with the least queue or KV usage sends every request of that window to
the same one or two pods (herding). The picker knows what it sent: per pod, the requests it routed
there since the pod's newest snapshot arrived. The count restarts when a newer snapshot of the pod
arrives, which shows those requests (waiting or running).

A policy sees each pod's ``waiting`` raised by its count *minus the smallest count among the
pods*: only what a pod got beyond the least-served one. The queue bands of the filter tree rank
pods relative to the lowest queue, so they see the full correction; but requests spread evenly
over every pod are mostly running, not waiting, and counting them all as queue would lift the
whole pool over the tree's absolute thresholds (a sheddable request needs a pod with
``waiting <= 5``), shedding below capacity when scrapes are slow.

Approximations: the count restarts when a snapshot *arrives*, not when it was taken, so requests
routed between a scrape and its arrival (scrape duration plus the NATS hop, about 5 ms of a 50 ms
interval) are counted by neither. Each picker replica counts only its own requests. Prompt sizes
are unknown to the picker, so KV usage is not corrected.

This corrects the policies' input, not the policies: ``lig picker --no-load-estimate`` turns it
off, leaving decisions on the scraped metrics alone, as upstream.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from scheduling.types import PodView


class UnreportedLoad:
    """Per pod, the requests routed there since its newest snapshot (always 0 when disabled)."""

    __slots__ = ("_counts", "enabled")

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._counts: dict[str, int] = {}

    def routed(self, pod: str) -> None:
        """A request was sent to ``pod``."""
        if self.enabled:
            self._counts[pod] = self._counts.get(pod, 0) + 1

    def unrouted(self, pod: str) -> None:
        """A request counted for ``pod`` went elsewhere after all (a gateway fallback)."""
        count = self._counts.get(pod, 0) - 1
        if count > 0:
            self._counts[pod] = count
        else:
            self._counts.pop(pod, None)

    def reported(self, pod: str) -> None:
        """A newer snapshot of ``pod`` arrived: it shows the requests counted so far."""
        self._counts.pop(pod, None)

    @property
    def counts(self) -> Mapping[str, int]:
        """Requests per pod that its newest snapshot does not show (pods with none absent)."""
        return self._counts


def picker_views(
    views: Sequence[PodView], in_flight: Mapping[str, int], unreported: Mapping[str, int]
) -> list[PodView]:
    """``views`` as a policy sees them: with this picker's in-flight counts, and ``waiting``
    raised by each pod's unreported requests beyond the fewest any of ``views`` has."""
    if not views or (not in_flight and not unreported):
        return list(views)
    # Counts are positive: with fewer counted pods than views, some view has none.
    if len(unreported) < len(views):
        fewest = 0
    else:
        fewest = min([unreported.get(view.name, 0) for view in views])
    replace = msgspec.structs.replace
    result = []
    for view in views:
        name = view.name
        requests = in_flight.get(name, 0)
        extra = unreported.get(name, 0) - fewest
        if requests or extra:
            view = replace(view, waiting=view.waiting + extra, in_flight=requests)
        result.append(view)
    return result
