"""Every case of upstream's filter tests (gateway-api-inference-extension PR #78 era
``pkg/ext-proc/scheduling/filter_test.go``), plus the tree branches they do not reach."""

from __future__ import annotations

import math
import random

import pytest

from scheduling import PodView, SchedulingRequest, build_policy
from scheduling.catalog import create_plugin
from scheduling.tree import Node, run_tree
from shared.schemas import Criticality, PolicyConfig

CRITICAL, STANDARD, SHEDDABLE = Criticality.CRITICAL, Criticality.STANDARD, Criticality.SHEDDABLE


def pod(
    name: str,
    waiting: int = 0,
    kv: float = 0.0,
    running: tuple[str, ...] = (),
    queued: tuple[str, ...] = (),
    max_lora: int = 0,
    in_flight: int = 0,
) -> PodView:
    return PodView(
        name=name,
        address=f"{name}:8000",
        waiting=waiting,
        kv_cache_usage=kv,
        running_adapters=frozenset(running),
        waiting_adapters=frozenset(queued),
        max_lora=max_lora,
        in_flight=in_flight,
    )


def request(target: str, criticality: Criticality = CRITICAL, model: str = "") -> SchedulingRequest:
    return SchedulingRequest(model=model or target, target_model=target, criticality=criticality)


def names(pods) -> list[str]:
    return [p.name for p in pods]


def filter_tree(**params):
    return build_policy(PolicyConfig(name="filter-tree", params=params), random.Random(0))


# upstream TestFilter ------------------------------------------------------------------------

UPSTREAM_PODS = [
    pod("pod1", waiting=0, kv=0.2, running=("foo", "bar"), max_lora=2),
    pod("pod2", waiting=3, kv=0.1, running=("foo", "critical"), max_lora=2),
    pod("pod3", waiting=10, kv=0.2, running=("foo",), max_lora=2),
]
SATURATED_PODS = [
    pod("pod1", waiting=10, kv=0.9, running=("foo", "bar"), max_lora=2),
    pod("pod2", waiting=3, kv=0.85, running=("foo", "critical"), max_lora=2),
    pod("pod3", waiting=10, kv=0.85, running=("foo",), max_lora=2),
]


def test_simple_filter_without_successor_failure() -> None:
    class Broken:
        def filter(self, req, pods):
            from scheduling.plugin import FilterFailed

            raise FilterFailed("filter error")

    root = Node("broken", Broken(), (None, ""), (None, ""))
    kept, error = run_tree(root, request("x"), UPSTREAM_PODS)
    assert kept == ()
    assert str(error) == "filter error"


@pytest.mark.parametrize(
    ("case", "req", "pods", "candidates", "shed"),
    [
        # pod2: relatively low queue, the requested model active, low KV cache.
        ("critical request", request("critical", CRITICAL), UPSTREAM_PODS, ["pod2"], False),
        # pod1 has capacity for the sheddable request.
        ("sheddable accepted", request("sheddable", SHEDDABLE), UPSTREAM_PODS, ["pod1"], False),
        # every pod is above the KV threshold: the sheddable request is dropped.
        ("sheddable dropped", request("sheddable", SHEDDABLE), SATURATED_PODS, [], True),
    ],
)
def test_default_filter(case, req, pods, candidates, shed) -> None:
    decision = filter_tree().schedule(req, pods)
    assert names(decision.candidates) == candidates, case
    assert decision.shed is shed
    assert (decision.pick.name if decision.pick else None) == (candidates or [None])[0]


# upstream TestFilterFunc --------------------------------------------------------------------


def run_plugin(plugin_type: str, pods, req=None, **params) -> list[PodView]:
    _, plugin = create_plugin(plugin_type, params, random.Random(0))
    return list(plugin.filter(req or request("model"), pods))


def test_least_queuing_empty_input() -> None:
    assert run_plugin("least_queue", []) == []


def test_least_queuing() -> None:
    pods = [pod("a", waiting=0), pod("b", waiting=3), pod("c", waiting=10)]
    assert names(run_plugin("least_queue", pods)) == ["a", "b"]  # band 0 + 10 // 3 = 3


def test_least_kv_cache_empty_input() -> None:
    assert run_plugin("least_kv_cache", []) == []


def test_least_kv_cache() -> None:
    pods = [pod("a", kv=0.0), pod("b", kv=0.3), pod("c", kv=1.0)]
    assert names(run_plugin("least_kv_cache", pods)) == ["a", "b"]  # band 0 + 1.0 / 3


def test_no_queue_and_less_than_kv_cache_threshold() -> None:
    pods = [
        pod("returned", waiting=0, kv=0.0),
        pod("queue non zero despite low kv", waiting=1, kv=0.3),
        pod("high kv despite zero queue", waiting=0, kv=1.0),
    ]
    kept = run_plugin("sheddable_capacity", pods, queue_threshold=0, kv_cache_threshold=0.8)
    assert names(kept) == ["returned"]


def test_low_lora_cost() -> None:
    pods = [
        pod("model active", running=("model",), max_lora=2),
        pod("room for another adapter", running=("another-model",), max_lora=2),
        pod("max active reached", running=("foo", "bar"), max_lora=2),
    ]
    assert names(run_plugin("low_lora_cost", pods)) == [
        "model active",
        "room for another adapter",
    ]


# band arithmetic beyond upstream's cases ------------------------------------------------------


@pytest.mark.parametrize(
    ("waiting", "kept"),
    [
        ([0, 1], [0]),  # 1 // 2 == 0: only the minimum
        ([0, 2, 4], [0]),  # 4 // 3 == 1
        ([1, 2, 4], [1, 2]),  # band [1, 2]
        ([7, 7, 7], [7, 7, 7]),  # no spread: everyone
        ([5], [5]),
    ],
)
def test_least_queuing_integer_band(waiting, kept) -> None:
    pods = [pod(f"p{i}", waiting=w) for i, w in enumerate(waiting)]
    assert [p.waiting for p in run_plugin("least_queue", pods)] == kept


def test_least_kv_cache_ignores_nan_like_upstream_comparisons() -> None:
    pods = [pod("nan", kv=math.nan), pod("low", kv=0.1), pod("high", kv=0.5)]
    assert names(run_plugin("least_kv_cache", pods)) == ["low"]  # 0.1 + 0.4 / 3
    assert run_plugin("least_kv_cache", [pod("a", kv=math.nan), pod("b", kv=math.nan)]) == []


# tree branches the upstream tests do not reach -------------------------------------------------

STEPS_NO_POD_UNDER_THRESHOLD = [
    "critical request",
    "low queueing filter",
    "least queuing",
    "low cost LoRA",
    "least KV cache percent",
    "random pick",
]


def test_no_pod_under_lora_queue_threshold() -> None:
    pods = [
        pod("affine", waiting=50, kv=0.5, running=("ad",), max_lora=2),
        pod("free-slot", waiting=52, kv=0.1, running=("x",), max_lora=2),
        pod("affine-long-queue", waiting=120, kv=0.0, running=("ad",), max_lora=2),
    ]
    decision = filter_tree().schedule(request("ad"), pods, explain=True)
    assert [step.step for step in decision.steps] == STEPS_NO_POD_UNDER_THRESHOLD
    assert decision.steps[1].kept == ()
    assert decision.steps[1].branch == "on_failure"
    assert decision.steps[2].entered == ("affine", "free-slot", "affine-long-queue")
    # least queuing band 50 + 70 // 3 = 73; both low-cost; KV band 0.1 + 0.4 / 2 = 0.3
    assert names(decision.candidates) == ["free-slot"]

    # With a higher threshold the same pods take the affinity branch instead.
    decision = filter_tree(queueing_threshold_lora=100).schedule(request("ad"), pods)
    assert names(decision.candidates) == ["affine"]


def test_queue_threshold_is_strict() -> None:
    pods = [pod("at-threshold", waiting=50, running=("ad",), max_lora=1), pod("under", waiting=49)]
    decision = filter_tree().schedule(request("ad"), pods, explain=True)
    assert decision.steps[1].kept == ("under",)


def test_no_affinity_falls_back_to_pods_that_can_load_the_adapter() -> None:
    pods = [
        pod("full", waiting=0, running=("x", "y"), max_lora=2),
        pod("free-slot", waiting=5, running=("x",), max_lora=2),
    ]
    decision = filter_tree().schedule(request("z"), pods, explain=True)
    assert [s.step for s in decision.steps][2:4] == ["affinity LoRA", "can accept LoRA Adapter"]
    assert names(decision.candidates) == ["free-slot"]


def test_no_free_slot_anywhere_passes_all_pods_to_queue_and_kv() -> None:
    pods = [
        pod("short-queue", waiting=0, running=("x", "y"), max_lora=2),
        pod("long-queue", waiting=5, running=("x", "w"), max_lora=2),
    ]
    decision = filter_tree().schedule(request("z"), pods, explain=True)
    can_accept = decision.steps[3]
    assert (can_accept.step, can_accept.kept) == ("can accept LoRA Adapter", ())
    assert can_accept.branch == "on_success_or_failure"
    assert decision.steps[4].entered == ("short-queue", "long-queue")
    assert names(decision.candidates) == ["short-queue"]  # band 0 + 5 // 2 = 2


def test_waiting_adapter_counts_as_active() -> None:
    pods = [
        pod("loading-it", waiting=4, kv=0.3, queued=("ad",), max_lora=2),
        pod("idle", waiting=0, kv=0.0, max_lora=2),
    ]
    assert names(filter_tree().schedule(request("ad"), pods).candidates) == ["loading-it"]


@pytest.mark.parametrize(
    ("running", "queued", "can_accept"),
    [
        (("x",), ("y",), False),  # two distinct adapters fill two slots
        (("x",), ("x",), True),  # the same adapter in both lists takes one slot
        ((), (), True),
    ],
)
def test_can_accept_counts_running_and_waiting_once(running, queued, can_accept) -> None:
    pods = [pod("p", running=running, queued=queued, max_lora=2)]
    assert bool(run_plugin("can_accept_lora", pods, request("z"))) is can_accept


def test_base_model_request_prefers_pods_with_a_free_adapter_slot() -> None:
    # The base model is in no adapter list, so (as upstream) it counts as needing a slot.
    pods = [pod("full", running=("x", "y"), max_lora=2), pod("free", running=("x",), max_lora=2)]
    req = request("llama", STANDARD, model="llama")
    decision = filter_tree().schedule(req, pods, explain=True)
    assert decision.steps[2].kept == ()
    assert names(decision.candidates) == ["free"]


@pytest.mark.parametrize("criticality", [CRITICAL, STANDARD])
def test_critical_and_standard_take_the_critical_branch(criticality) -> None:
    req = request("critical", criticality)
    decision = filter_tree().schedule(req, SATURATED_PODS, explain=True)
    assert decision.steps[1].step == "low queueing filter"
    assert decision.pick is not None and not decision.shed


@pytest.mark.parametrize(
    ("waiting", "kv", "accepted"),
    [(5, 0.8, True), (6, 0.1, False), (0, 0.81, False)],
)
def test_sheddable_capacity_bounds(waiting, kv, accepted) -> None:
    decision = filter_tree().schedule(request("s", SHEDDABLE), [pod("p", waiting, kv)])
    assert (decision.pick is not None, decision.shed) == (accepted, not accepted)


def test_sheddable_thresholds_are_parameters() -> None:
    pods = [pod("p", waiting=8, kv=0.9)]
    relaxed = filter_tree(queue_threshold_critical=10, kv_cache_threshold=0.95)
    assert relaxed.schedule(request("s", SHEDDABLE), pods).pick is not None
    assert filter_tree().schedule(request("s", SHEDDABLE), pods).shed
