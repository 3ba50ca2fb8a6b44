"""``shed``: drop the request (upstream's "drop request" step; the picker answers 429)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from scheduling.plugin import ShedRequest, no_params
from scheduling.types import PodView, SchedulingRequest


class Shed:
    """Always fail with :class:`ShedRequest`."""

    __slots__ = ()

    def filter(self, request: SchedulingRequest, pods: Sequence[PodView]) -> Sequence[PodView]:
        """Refuse the request."""
        raise ShedRequest("dropping request due to limited backend resources")


def create(params: Mapping[str, Any], rng: random.Random) -> Shed:
    """Build the filter (it takes no parameters)."""
    no_params(params, "shed")
    return Shed()
