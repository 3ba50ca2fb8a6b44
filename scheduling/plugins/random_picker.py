"""``random``: pick uniformly at random among the candidates (upstream's final ``rand.Intn``)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from scheduling.plugin import PluginRecord
from scheduling.types import PodView, SchedulingRequest


class RandomPicker:
    """Uniform choice from the policy's injected random source (seedable, so reproducible)."""

    __slots__ = ("_choice",)

    def __init__(self, rng: random.Random) -> None:
        self._choice = rng.choice

    def pick(self, request: SchedulingRequest, pods: Sequence[PodView]) -> PodView:
        """Return a uniformly chosen pod."""
        return self._choice(pods)


PLUGIN = PluginRecord("random", "picker", RandomPicker, takes_rng=True)
