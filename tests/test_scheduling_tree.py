"""The decision-tree node semantics and building trees from data specs."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from scheduling import PodView, PolicyConfigError, SchedulingRequest
from scheduling.catalog import PLUGIN_TYPES
from scheduling.plugin import FilterFailed, PluginRecord, ShedRequest
from scheduling.tree import Node, build_tree, run_tree

PODS = [PodView(name=f"p{i}", address=f"10.0.0.{i}:8000", waiting=i) for i in range(4)]
REQ = SchedulingRequest(model="m", target_model="m")


class Recording:
    """A fake filter: records its input and returns what ``keep`` selects (or raises)."""

    def __init__(self, keep=lambda pods: list(pods), error: Exception | None = None) -> None:
        self.keep, self.error = keep, error
        self.inputs: list[list[str]] = []

    def filter(self, request: SchedulingRequest, pods: Sequence[PodView]) -> Sequence[PodView]:
        self.inputs.append([p.name for p in pods])
        if self.error is not None:
            raise self.error
        return self.keep(pods)


def leaf(name: str, step: Recording) -> Node:
    return Node(name, step, (None, ""), (None, ""))


def names(pods: Sequence[PodView]) -> list[str]:
    return [p.name for p in pods]


def test_empty_result_passes_the_steps_own_input_to_on_failure() -> None:
    first = Recording(keep=lambda pods: pods[:2])
    empties = Recording(keep=lambda pods: [])
    fallback = Recording()
    root = Node(
        "first",
        first,
        (Node("empties", empties, (None, ""), (leaf("fallback", fallback), "on_failure")), "x"),
        (None, ""),
    )
    kept, error = run_tree(root, REQ, PODS)
    # the failing step's own input (first's output), not the tree's input
    assert fallback.inputs == [["p0", "p1"]]
    assert (names(kept), error) == (["p0", "p1"], None)


def test_error_passes_input_to_on_failure() -> None:
    fallback = Recording()
    broken = Recording(error=FilterFailed("boom"))
    root = Node("broken", broken, (None, ""), (leaf("fallback", fallback), "on_failure"))
    kept, _ = run_tree(root, REQ, PODS)
    assert fallback.inputs == [names(PODS)]
    assert names(kept) == names(PODS)


def test_failure_without_on_failure_fails_the_decision() -> None:
    kept, error = run_tree(leaf("empty", Recording(keep=lambda pods: [])), REQ, PODS)
    assert kept == ()
    assert isinstance(error, FilterFailed) and "empty" in str(error)
    kept, error = run_tree(leaf("shed", Recording(error=ShedRequest("full"))), REQ, PODS)
    assert kept == () and isinstance(error, ShedRequest)


def test_unexpected_exceptions_are_not_swallowed() -> None:
    with pytest.raises(ZeroDivisionError):
        run_tree(leaf("bug", Recording(error=ZeroDivisionError())), REQ, PODS)


def test_success_without_successor_ends_with_kept_pods() -> None:
    kept, error = run_tree(leaf("half", Recording(keep=lambda pods: pods[2:])), REQ, PODS)
    assert (names(kept), error) == (["p2", "p3"], None)


SPEC = {
    "name": "short queues",
    "plugin": "low_queue",
    "params": {"threshold": 2},
    "on_success_or_failure": {"name": "least waiting", "plugin": "waiting"},
}


def test_on_success_or_failure_serves_both_outcomes_and_scorer_keeps_best() -> None:
    root = build_tree(SPEC, random.Random(0))
    trace: list = []
    kept, _ = run_tree(root, REQ, PODS, trace)
    assert names(kept) == ["p0"]
    assert [(t.step, t.branch) for t in trace] == [
        ("short queues", "on_success_or_failure"),
        ("least waiting", "done"),
    ]
    # failure of the first step (no pod under 0) still reaches the scorer, with all pods
    root = build_tree({**SPEC, "params": {"threshold": 0}}, random.Random(0))
    trace = []
    kept, _ = run_tree(root, REQ, PODS, trace)
    assert trace[0].kept == () and trace[1].entered == tuple(names(PODS))
    assert names(kept) == ["p0"]


def test_specific_branch_overrides_on_success_or_failure() -> None:
    spec = {**SPEC, "on_success": {"name": "least KV", "plugin": "least_kv_cache"}}
    trace: list = []
    run_tree(build_tree(spec, random.Random(0)), REQ, PODS, trace)
    assert [(t.step, t.branch) for t in trace] == [
        ("short queues", "on_success"),
        ("least KV", "done"),
    ]


def test_failed_step_trace_records_failed_branch() -> None:
    spec = {"name": "none short", "plugin": "low_queue", "params": {"threshold": 0}}
    trace: list = []
    kept, error = run_tree(build_tree(spec, random.Random(0)), REQ, PODS, trace)
    assert kept == () and error is not None
    assert [(t.step, t.kept, t.branch) for t in trace] == [("none short", (), "failed")]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"name": "x", "plugin": "nope"}, "unknown plugin type 'nope'"),
        ({"name": "x", "plugin": "low_queue", "colour": 1}, "colour"),
        ({"name": "x", "plugin": "random"}, "is a picker"),
        ({"name": "x", "plugin": "low_queue", "params": {"limit": 3}}, "'limit'"),
        ({"name": "x", "plugin": "low_queue", "params": {"threshold": "3"}}, "'threshold'"),
        ({"name": "x", "plugin": "least_queue", "params": {"k": 1}}, "'k'"),
        ({"plugin": "low_queue"}, "name"),
    ],
)
def test_bad_specs_raise_policy_config_error(spec, message) -> None:
    with pytest.raises(PolicyConfigError, match=message):
        build_tree(spec, random.Random(0))


def test_a_plugin_registered_as_the_wrong_kind_is_a_config_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A filter registered as a scorer: caught when the tree is built, not as an AttributeError
    # on the first request.
    monkeypatch.setitem(PLUGIN_TYPES, "mislabelled",
                        PluginRecord("mislabelled", "scorer", Recording))
    with pytest.raises(PolicyConfigError, match="registered as a scorer but does not implement"):
        build_tree({"name": "x", "plugin": "mislabelled"}, random.Random(0))
