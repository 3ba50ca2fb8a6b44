"""``token_load``: prefer pods with fewer prompt tokens routed to them but not yet reported.

The tokens are those each pod must prefill: a prefix it caches (per the picker's prefix index)
does not count (``services/picker/load_estimate.py``).

Score ``1 / (1 + unreported_tokens / token_scale)``: 1 for a pod that got nothing since its
snapshot, 0.5 at ``token_scale`` tokens. The scale is absolute, not relative to the other pods,
so three 50-token prompts barely count while three 8,000-token prompts weigh like the prefill
work they are (a request count treats them alike).

``recent`` (the default policy's setting) rates ``PodView.recent_tokens`` instead: the same
tokens, own and peers', fading with their time since routing, whatever the snapshots. The
unreported tokens restart with each pod's snapshot, so the pod scraped last looks the least
loaded and, with 200 ms scrapes, got the decisions until the next (issue 24).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec

from scheduling.plugin import PluginRecord
from scheduling.types import PodView, SchedulingRequest


class TokenLoadParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``token_scale``: the unreported prompt tokens that halve a pod's score; ``recent``: rate
    the recent prefill tokens (``PodView.recent_tokens``) instead of the unreported ones."""

    token_scale: Annotated[int, msgspec.Meta(ge=1)] = 4096
    recent: bool = False


class TokenLoad:
    """Score ``1 / (1 + unreported_tokens / token_scale)``."""

    __slots__ = ("_recent", "_scale")

    def __init__(self, token_scale: int, recent: bool = False) -> None:
        self._scale = float(token_scale)
        self._recent = recent

    def score(self, request: SchedulingRequest, pods: Sequence[PodView]) -> list[float]:
        """One score per pod, in (0, 1]."""
        scale = self._scale
        if self._recent:
            return [scale / (scale + pod.recent_tokens) for pod in pods]
        return [scale / (scale + pod.unreported_tokens) for pod in pods]


PLUGIN = PluginRecord("token_load", "scorer", TokenLoad, TokenLoadParams)
