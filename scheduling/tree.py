"""The decision tree: steps built from a data spec, run with upstream's branch semantics.

Each step runs one filter (or a scorer, as "keep the best-scored pods"). If it keeps at least
one pod, the kept pods go to ``on_success``; if it keeps none or raises :class:`FilterFailed`,
the step's own *input* goes to ``on_failure``. ``on_success_or_failure`` is the successor for
whichever of the two is not set, as upstream's ``nextOnSuccessOrFailure``. A successful step
without successor ends the tree with its pods; a failed step without successor fails the
decision (with the step's error, e.g. :class:`ShedRequest`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import msgspec

from scheduling.catalog import create_plugin
from scheduling.params import PolicyConfigError
from scheduling.plugin import BestScore, Filter, FilterFailed, Scorer
from scheduling.types import PodView, SchedulingRequest, StepTrace


class StepSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One step of a tree as data: a display name, a plugin type and its params, successors."""

    name: str
    plugin: str
    params: dict[str, Any] = {}
    on_success: StepSpec | None = None
    on_failure: StepSpec | None = None
    on_success_or_failure: StepSpec | None = None


class Node:
    """A built step: the filter to run and the resolved successor for each outcome."""

    __slots__ = ("apply", "failure_branch", "name", "on_failure", "on_success", "success_branch")

    def __init__(
        self,
        name: str,
        step: Filter,
        on_success: tuple[Node | None, str],
        on_failure: tuple[Node | None, str],
    ) -> None:
        self.name = name
        self.apply = step.filter
        self.on_success, self.success_branch = on_success
        self.on_failure, self.failure_branch = on_failure


def parse_spec(spec: Any) -> StepSpec:
    """Turn a nested dict (or a :class:`StepSpec`) into a checked :class:`StepSpec`."""
    if isinstance(spec, StepSpec):
        return spec
    try:
        return msgspec.convert(spec, StepSpec)
    except msgspec.ValidationError as exc:
        raise PolicyConfigError(f"invalid tree spec: {exc}") from None


def build_tree(spec: Any, rng: random.Random) -> Node:
    """Build the nodes of a tree spec, creating each step's plugin from the catalog."""
    return _build(parse_spec(spec), rng)


def _build(spec: StepSpec, rng: random.Random) -> Node:
    entry, plugin = create_plugin(spec.plugin, spec.params, rng)
    if entry.kind == "scorer" and isinstance(plugin, Scorer):
        step: Filter = BestScore(plugin)
    elif entry.kind == "filter" and isinstance(plugin, Filter):
        step = plugin
    elif entry.kind in ("filter", "scorer"):
        raise PolicyConfigError(f"step {spec.name!r}: plugin {spec.plugin!r} is registered as "
                                f"a {entry.kind} but does not implement one")
    else:
        raise PolicyConfigError(
            f"step {spec.name!r}: plugin {spec.plugin!r} is a {entry.kind}, not a filter or scorer"
        )
    either = _successor(spec.on_success_or_failure, "on_success_or_failure", rng)
    on_success = _successor(spec.on_success, "on_success", rng) if spec.on_success else either
    on_failure = _successor(spec.on_failure, "on_failure", rng) if spec.on_failure else either
    return Node(spec.name, step, on_success, on_failure)


def _successor(spec: StepSpec | None, branch: str, rng: random.Random) -> tuple[Node | None, str]:
    return (None, "") if spec is None else (_build(spec, rng), branch)


def run_tree(
    root: Node,
    request: SchedulingRequest,
    pods: Sequence[PodView],
    trace: list[StepTrace] | None = None,
) -> tuple[Sequence[PodView], FilterFailed | None]:
    """Run the tree from ``root``: the surviving pods, or ``()`` and the failing step's error.

    With ``trace`` given, one :class:`StepTrace` per step is appended; its ``branch`` is the
    edge taken (``on_success``, ``on_failure``, ``on_success_or_failure``), ``done`` when the
    tree ends successfully there, ``failed`` when the decision fails there.
    """
    node = root
    while True:
        error: FilterFailed | None = None
        try:
            kept = node.apply(request, pods)
        except FilterFailed as exc:
            kept, error = (), exc
        if kept:
            successor = node.on_success
            if trace is not None:
                branch = node.success_branch if successor is not None else "done"
                trace.append(StepTrace(node.name, _names(pods), _names(kept), branch))
            if successor is None:
                return kept, None
            pods = kept
        else:
            successor = node.on_failure
            if trace is not None:
                branch = node.failure_branch if successor is not None else "failed"
                trace.append(StepTrace(node.name, _names(pods), (), branch))
            if successor is None:
                return (), error or FilterFailed(f"step {node.name!r} left no pods")
        node = successor


def _names(pods: Sequence[PodView]) -> tuple[str, ...]:
    return tuple(pod.name for pod in pods)
