"""The data every scheduling policy works on: pod views in, a decision out."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import msgspec

from shared.schemas import Criticality


class PodView(msgspec.Struct, frozen=True):
    """What a policy knows about one pod: newest metrics and this picker's in-flight count."""

    name: str
    address: str
    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    max_lora: int = 0
    in_flight: int = 0


class SchedulingRequest(msgspec.Struct, frozen=True):
    """One request as the policy sees it: the name asked for, the resolved target, criticality."""

    model: str
    target_model: str
    criticality: Criticality = Criticality.STANDARD


class StepTrace(msgspec.Struct, frozen=True):
    """One step of a decision: which pods entered, which it kept, and the branch taken next."""

    step: str
    entered: tuple[str, ...]
    kept: tuple[str, ...]
    branch: str


class Decision(msgspec.Struct, frozen=True):
    """A policy's answer: the pick (None when shed or no pod), the final candidates, the path."""

    pick: PodView | None
    candidates: tuple[PodView, ...]
    shed: bool = False
    steps: tuple[StepTrace, ...] = ()


class Policy(Protocol):
    """A scheduling policy; instances may keep state (a round-robin cursor) and own an RNG."""

    name: str

    def schedule(
        self, request: SchedulingRequest, pods: Sequence[PodView], *, explain: bool = False
    ) -> Decision:
        """Choose a pod for ``request``; fill ``Decision.steps`` only when ``explain`` is set."""
        ...


class PolicyFactory(Protocol):
    """Builds a policy from its configured parameters and a random source."""

    def __call__(self, params: Mapping[str, Any], rng: random.Random) -> Policy: ...
