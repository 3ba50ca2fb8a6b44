"""The scheduling policies: each one a tree spec (data) plus a final picker.

``filter-tree`` is the upstream decision tree of PR #78 (kubernetes-sigs/
gateway-api-inference-extension, December 2024) with its thresholds as parameters; the baselines
``least-queue``, ``random`` and ``round-robin`` are built the same way, so a new policy is a new
spec beside these. ``prefix-aware`` is a scheduler profile instead (filters -> weighted scorers ->
picker, ``scheduling/profile.py``), whose params may recompose it.

Choices where upstream is silent or differs:
- Criticality: Critical and Standard take the critical branch, Sheddable the sheddable one.
- An adapter is active on a pod when it is in the pod's running or waiting adapters; a pod's
  used slots are the union of both lists (see ``plugins/can_accept_lora.py``).
- A base-model request (``target_model`` in no adapter list) goes through the same tree: the
  affinity step keeps no pod, so it prefers pods with a free adapter slot, as upstream does.
- An empty pod list gives no pick and no shed (the picker answers 503); a tree that fails
  without shedding does the same.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import msgspec

from scheduling.catalog import create_plugin
from scheduling.params import PolicyConfigError, parse_params
from scheduling.plugin import FilterFailed, NoParams, Picker, ShedRequest
from scheduling.profile import build_profile
from scheduling.tree import Node, build_tree, run_tree
from scheduling.types import (
    Decision,
    PodView,
    Policy,
    PolicyFactory,
    SchedulingRequest,
    StepTrace,
)
from shared.schemas import PolicyConfig


class FilterTreeParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Thresholds of the filter tree; names and defaults are upstream's, in snake_case."""

    queueing_threshold_lora: Annotated[int, msgspec.Meta(ge=0)] = 50
    queue_threshold_critical: Annotated[int, msgspec.Meta(ge=0)] = 5
    kv_cache_threshold: Annotated[float, msgspec.Meta(ge=0.0)] = 0.8


def filter_tree_spec(p: FilterTreeParams) -> dict[str, Any]:
    """The upstream tree as data; step names are upstream's filter names."""
    least_kv_cache = {"name": "least KV cache percent", "plugin": "least_kv_cache"}
    # upstream queueAndKVCacheFilter: least queue -> least KV cache
    queue_and_kv_cache = {
        "name": "least queuing",
        "plugin": "least_queue",
        "on_success_or_failure": least_kv_cache,
    }
    # upstream queueLoRAAndKVCacheFilter: least queue -> low cost LoRA -> least KV cache
    queue_lora_and_kv_cache = {
        "name": "least queuing",
        "plugin": "least_queue",
        "on_success_or_failure": {
            "name": "low cost LoRA",
            "plugin": "low_lora_cost",
            "on_success_or_failure": least_kv_cache,
        },
    }
    # Under the LoRA queue threshold, affinity comes first (strong affinity), then queue and KV.
    low_latency = {
        "name": "low queueing filter",
        "plugin": "low_queue",
        "params": {"threshold": p.queueing_threshold_lora},
        "on_success": {
            "name": "affinity LoRA",
            "plugin": "lora_affinity",
            "on_success": queue_and_kv_cache,
            "on_failure": {
                "name": "can accept LoRA Adapter",
                "plugin": "can_accept_lora",
                "on_success_or_failure": queue_and_kv_cache,
            },
        },
        "on_failure": queue_lora_and_kv_cache,
    }
    sheddable = {
        "name": "has capacity for sheddable requests",
        "plugin": "sheddable_capacity",
        "params": {
            "queue_threshold": p.queue_threshold_critical,
            "kv_cache_threshold": p.kv_cache_threshold,
        },
        "on_success": queue_lora_and_kv_cache,
        "on_failure": {"name": "drop request", "plugin": "shed"},
    }
    return {
        "name": "critical request",
        "plugin": "critical_request",
        "on_success": low_latency,
        "on_failure": sheddable,
    }


def least_queue_spec() -> dict[str, Any]:
    """Baseline: the pods with the fewest waiting requests, ties by fewest in flight here."""
    return {
        "name": "least waiting",
        "plugin": "waiting",
        "on_success": {"name": "least in flight", "plugin": "in_flight"},
    }


class TreePolicy:
    """A policy made of an optional decision tree and a picker for the final candidates."""

    def __init__(self, name: str, root: Node | None, picker: Picker, picker_name: str) -> None:
        self.name = name
        self._root = root
        self._pick = picker.pick
        self._picker_name = picker_name

    def schedule(
        self, request: SchedulingRequest, pods: Sequence[PodView], *, explain: bool = False
    ) -> Decision:
        """Run the tree over ``pods`` and pick among the survivors."""
        if not pods:
            return _NO_PICK
        if explain:
            return self._schedule_explained(request, pods)
        if self._root is None:
            kept, error = pods, None
        else:
            kept, error = run_tree(self._root, request, pods)
        if not kept:
            return _SHED if isinstance(error, ShedRequest) else _NO_PICK
        return Decision(pick=self._pick(request, kept), candidates=tuple(kept))

    def _schedule_explained(self, request: SchedulingRequest, pods: Sequence[PodView]) -> Decision:
        trace: list[StepTrace] = []
        error: FilterFailed | None = None
        if self._root is None:
            kept: Sequence[PodView] = pods
        else:
            kept, error = run_tree(self._root, request, pods, trace)
        if not kept:
            shed = isinstance(error, ShedRequest)
            return Decision(pick=None, candidates=(), shed=shed, steps=tuple(trace))
        pick = self._pick(request, kept)
        names = tuple(pod.name for pod in kept)
        trace.append(StepTrace(self._picker_name, names, (pick.name,), "done"))
        return Decision(pick=pick, candidates=tuple(kept), steps=tuple(trace))


_NO_PICK = Decision(pick=None, candidates=())
_SHED = Decision(pick=None, candidates=(), shed=True)


def _filter_tree(params: Mapping[str, Any], rng: random.Random) -> Policy:
    p = parse_params(params, FilterTreeParams, "policy 'filter-tree'")
    return _tree_policy("filter-tree", filter_tree_spec(p), "random", rng)


def _least_queue(params: Mapping[str, Any], rng: random.Random) -> Policy:
    parse_params(params, NoParams, "policy 'least-queue'")
    return _tree_policy("least-queue", least_queue_spec(), "random", rng)


def _random(params: Mapping[str, Any], rng: random.Random) -> Policy:
    parse_params(params, NoParams, "policy 'random'")
    return _tree_policy("random", None, "random", rng)


def _round_robin(params: Mapping[str, Any], rng: random.Random) -> Policy:
    parse_params(params, NoParams, "policy 'round-robin'")
    return _tree_policy("round-robin", None, "round_robin", rng)


def _prefix_aware(params: Mapping[str, Any], rng: random.Random) -> Policy:
    return build_profile("prefix-aware", params, rng)


def _tree_policy(
    name: str, spec: dict[str, Any] | None, picker_type: str, rng: random.Random
) -> TreePolicy:
    root = None if spec is None else build_tree(spec, rng)
    entry, picker = create_plugin(picker_type, {}, rng)
    if entry.kind != "picker" or not isinstance(picker, Picker):
        raise PolicyConfigError(f"policy {name!r}: plugin {picker_type!r} is not a picker")
    return TreePolicy(name, root, picker, f"{picker_type} pick")


POLICIES: dict[str, PolicyFactory] = {
    "prefix-aware": _prefix_aware,
    "filter-tree": _filter_tree,
    "round-robin": _round_robin,
    "random": _random,
    "least-queue": _least_queue,
}


def policy_names() -> list[str]:
    """The names ``build_policy`` accepts, the default (``prefix-aware``) first."""
    return list(POLICIES)


def build_policy(config: PolicyConfig, rng: random.Random) -> Policy:
    """Build the policy ``config`` names, with its params; :class:`PolicyConfigError` if unusable.

    ``rng`` is the policy's only random source: seed it for reproducible decisions.
    """
    factory = POLICIES.get(config.name)
    if factory is None:
        known = ", ".join(POLICIES)
        raise PolicyConfigError(f"unknown policy {config.name!r} (known: {known})")
    return factory(config.params, rng)
