"""The picker's decision core, built one way for ``lig picker``, ``lig bench`` and ``lig explain``.

The core is a :class:`~services.picker.pools.Gateway`: per served pool a
:class:`~services.picker.routing.Router` (model resolution with the weighted draw, criticality,
the pool's policy) over a :class:`~services.picker.state.PodTable` (snapshots, freshness, load
estimate, in-flight counts, gray pods). ext_proc feeds it request bodies (``route``) and stream
ends (``started`` / ``finished``); the metrics feed feeds it snapshots. The benchmark drives the
very same objects in virtual time (``clock``), so its numbers describe the code that ships.

:class:`PickerSettings` holds the picker's defaults (``lig picker``'s flags of the same names;
``tests/test_picker_core.py`` checks that they agree), so ``lig bench --policies default`` runs
exactly what a picker started without flags runs.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from services.picker.gray_pods import GrayPods
from services.picker.pools import Gateway, UnknownModels
from services.picker.routing import Router
from services.picker.state import PodTable


class PickerSettings(msgspec.Struct, frozen=True):
    """The core's settings; each default is the default of ``lig picker``'s flag of that name."""

    stale_after: float = 1.0
    load_estimate: bool = True
    gray_after: float = 2.0
    outcome_sample: int = 4
    fallbacks: int = 0


class CoreHooks(msgspec.Struct, frozen=True):
    """Where the core reports what a service counts (all optional: a tool ignores them)."""

    on_gray_exclusion: Callable[[str, str], None] = lambda pod, reason: None
    on_all_stale: Callable[[], None] = lambda: None
    on_conflicts: Callable[[int], None] = lambda count: None


def build_gateway(pools: Sequence[str], settings: PickerSettings | None = None, *,
                  rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic,
                  unknown: UnknownModels | None = None, hooks: CoreHooks | None = None,
                  on_decision: Callable[[str, Any], None] | None = None,
                  picker_id: str = "") -> Gateway:
    """The decision core over ``pools`` (empty: every pool of the registry).

    ``clock`` is the time freshness and gray pods are judged on (virtual time in the bench).
    ``on_decision(pool, event)`` receives the core's own routed/finished/shed events for the
    decision stream, ``picker_id`` naming this picker in it (its own batches are not applied
    twice); both are passed on only when ``on_decision`` is given, and need a ``Gateway`` that
    publishes its decisions.
    """
    settings = settings if settings is not None else PickerSettings()
    hooks = hooks if hooks is not None else CoreHooks()
    rng = rng if rng is not None else random.Random()

    def make_router(pool: str) -> Router:
        pods = PodTable(settings.stale_after, clock=clock, load_estimate=settings.load_estimate,
                        gray=GrayPods(settings.gray_after, settings.outcome_sample,
                                      on_exclude=hooks.on_gray_exclusion))
        return Router(pool, pods, rng, on_all_stale=hooks.on_all_stale,
                      fallbacks=settings.fallbacks)

    extra: dict[str, Any] = {}
    if on_decision is not None:
        extra = {"on_decision": on_decision, "picker_id": picker_id}
    return Gateway(pools, make_router, unknown, rng, on_conflicts=hooks.on_conflicts, **extra)


def shares_decisions() -> bool:
    """Whether this core can publish its decisions and apply its peers' (the decision stream)."""
    return hasattr(Gateway, "apply_peer")
