"""The data every scheduling policy works on: pod views in, a decision out."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol

import msgspec

from shared.schemas import Criticality


class PodView(msgspec.Struct, frozen=True, array_like=True):
    """What a policy knows about one pod: newest metrics and this picker's in-flight count.

    Encoded as a positional array: decision records carry one per candidate pod
    (``scheduling/record.py``), so field order is part of the recording contract.
    """

    name: str
    address: str
    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    max_lora: int = 0
    in_flight: int = 0
    # Prompt tokens routed to the pod (by this picker and its peers) that its newest snapshot
    # does not show yet, counting only those it must prefill, not the prefix it caches (see
    # services/picker/load_estimate.py).
    unreported_tokens: int = 0
    # Seconds since the pod's newest snapshot was scraped, at decision time (the picker's
    # estimate; 0: exact state): how stale waiting, running and KV usage are.
    age: float = 0.0
    # Seconds by which peer pickers' decisions reach this picker (0: no peer heard from):
    # decisions taken within it are in no count yet. The same for every pod of a decision.
    peer_lag: float = 0.0
    # Prompt tokens routed to the pod (by this picker and its peers) that it must prefill,
    # each fading out exponentially with its time since routing (services/picker/
    # load_estimate.py, RecentWork): the prefill likely still ahead of a new request, the same
    # measure for every pod whatever its snapshot's age.
    recent_tokens: float = 0.0
    # Decisions peer pickers probably took in the last ``peer_lag`` that no count here holds
    # yet (their routing rate times their lag; 0: no peers). The same for every pod.
    peer_unseen: float = 0.0
    # The part of ``waiting`` that is the load estimate's (unreported requests beyond the
    # fewest any pod has), not the pod's report.
    waiting_estimated: int = 0


_NO_HITS: Mapping[str, int] = MappingProxyType({})


class SchedulingRequest(msgspec.Struct, frozen=True):
    """One request as the policy sees it: the name asked for, the resolved target, criticality,
    and what the picker read of its prompt.

    ``prompt_tokens`` is the estimate of ``scheduling/prompt.py``; ``max_tokens`` the client's
    completion limit (0: none given); ``prefix_hashes`` the chained hashes of the prompt's
    leading fixed-size blocks (``scheduling/prefix_hash.py``; deterministic across processes),
    or, when the router scores precisely from KV-cache events, the keys of the prompt's token
    blocks (``scheduling/token_blocks.py``); ``prefix_hits`` maps a pod name to the number of
    those leading blocks the pool's prefix indexes say that pod holds (filled by the Router
    before the policy runs; pods with none absent).
    """

    model: str
    target_model: str
    criticality: Criticality = Criticality.STANDARD
    prompt_tokens: int = 0
    max_tokens: int = 0
    prefix_hashes: tuple[int, ...] = ()
    prefix_hits: Mapping[str, int] = _NO_HITS


class StepTrace(msgspec.Struct, frozen=True):
    """One step of a decision: which pods entered, which it kept, and the branch taken next."""

    step: str
    entered: tuple[str, ...]
    kept: tuple[str, ...]
    branch: str


class PodScore(msgspec.Struct, frozen=True):
    """One pod's score in a scorer pipeline: the weighted total and each scorer's raw score."""

    pod: str
    total: float
    scores: dict[str, float]


class Decision(msgspec.Struct, frozen=True):
    """A policy's answer: the pick (None when shed or no pod), the final candidates, the path,
    and (scorer pipelines, when explained) every candidate's scores."""

    pick: PodView | None
    candidates: tuple[PodView, ...]
    shed: bool = False
    steps: tuple[StepTrace, ...] = ()
    scores: tuple[PodScore, ...] = ()


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
