"""build_policy, the baselines, determinism, config errors and explanations."""

from __future__ import annotations

import collections
import random

import pytest

from scheduling import (
    PodView,
    PolicyConfigError,
    SchedulingRequest,
    build_policy,
    policy_names,
)
from shared.schemas import Criticality, PolicyConfig


def pod(name: str, waiting: int = 0, kv: float = 0.0, in_flight: int = 0) -> PodView:
    return PodView(
        name=name, address=f"{name}:1", waiting=waiting, kv_cache_usage=kv, in_flight=in_flight
    )


REQ = SchedulingRequest(model="m", target_model="m", criticality=Criticality.CRITICAL)
EQUAL_PODS = [pod(f"p{i}") for i in range(8)]


def policy(name: str, seed: int = 0, **params):
    return build_policy(PolicyConfig(name=name, params=params), random.Random(seed))


def test_policy_names_default_first() -> None:
    assert policy_names() == ["prefix-aware", "filter-tree", "round-robin", "random", "least-queue"]
    assert PolicyConfig().name == policy_names()[0]
    for name in policy_names():
        assert policy(name).name == name


@pytest.mark.parametrize("name", ["filter-tree", "round-robin", "random", "least-queue"])
def test_empty_pod_list_gives_no_pick_and_no_shed(name) -> None:
    for explain in (False, True):
        decision = policy(name).schedule(REQ, [], explain=explain)
        assert (decision.pick, decision.candidates, decision.shed) == (None, (), False)


@pytest.mark.parametrize("name", ["filter-tree", "random", "least-queue"])
def test_seeded_rng_makes_decisions_reproducible(name) -> None:
    def picks(seed: int) -> list[str]:
        p = policy(name, seed)
        return [p.schedule(REQ, EQUAL_PODS).pick.name for _ in range(40)]

    assert picks(7) == picks(7)
    assert picks(7) != picks(8)


def test_final_pick_is_uniform_among_survivors() -> None:
    p = policy("filter-tree", seed=3)
    pods = [*EQUAL_PODS[:3], pod("busy", waiting=40, kv=0.9)]
    counts = collections.Counter(p.schedule(REQ, pods).pick.name for _ in range(3000))
    assert set(counts) == {"p0", "p1", "p2"}
    assert all(850 <= n <= 1150 for n in counts.values()), counts


def test_explain_does_not_change_the_pick() -> None:
    plain, explained = policy("filter-tree", 11), policy("filter-tree", 11)
    for _ in range(20):
        a = plain.schedule(REQ, EQUAL_PODS)
        b = explained.schedule(REQ, EQUAL_PODS, explain=True)
        assert a.pick == b.pick and a.candidates == b.candidates
        assert a.steps == () and b.steps


def test_round_robin_cycles_in_order() -> None:
    p = policy("round-robin")
    picks = [p.schedule(REQ, EQUAL_PODS[:3]).pick.name for _ in range(7)]
    assert picks == ["p0", "p1", "p2", "p0", "p1", "p2", "p0"]


def test_random_keeps_every_pod_as_candidate() -> None:
    decision = policy("random").schedule(REQ, EQUAL_PODS, explain=True)
    assert decision.candidates == tuple(EQUAL_PODS)
    assert [(s.step, s.kept) for s in decision.steps] == [("random pick", (decision.pick.name,))]


def test_least_queue_prefers_least_waiting_then_least_in_flight() -> None:
    pods = [
        pod("long", waiting=3),
        pod("short-busy", waiting=1, in_flight=4),
        pod("short-a", waiting=1, in_flight=2),
        pod("short-b", waiting=1, in_flight=2),
    ]
    p = policy("least-queue", seed=5)
    decision = p.schedule(REQ, pods, explain=True)
    assert [s.step for s in decision.steps] == ["least waiting", "least in flight", "random pick"]
    assert [p.name for p in decision.candidates] == ["short-a", "short-b"]
    picks = {p.schedule(REQ, pods).pick.name for _ in range(50)}
    assert picks == {"short-a", "short-b"}


def test_explanation_contents_for_shed_request() -> None:
    saturated = [pod("a", waiting=9, kv=0.9), pod("b", waiting=7, kv=0.95)]
    req = SchedulingRequest(model="m", target_model="m", criticality=Criticality.SHEDDABLE)
    decision = policy("filter-tree").schedule(req, saturated, explain=True)
    assert decision.shed and decision.pick is None and decision.candidates == ()
    assert [(s.step, s.entered, s.kept, s.branch) for s in decision.steps] == [
        ("critical request", ("a", "b"), (), "on_failure"),
        ("has capacity for sheddable requests", ("a", "b"), (), "on_failure"),
        ("drop request", ("a", "b"), (), "failed"),
    ]


def test_candidates_keep_input_order() -> None:
    pods = [pod("z"), pod("busy", waiting=40), pod("a"), pod("m")]
    decision = policy("filter-tree").schedule(REQ, pods)
    assert [p.name for p in decision.candidates] == ["z", "a", "m"]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (PolicyConfig(name="fastest"), "unknown policy 'fastest'"),
        (PolicyConfig(params={"queue_threshold": 3}), "unknown parameter 'queue_threshold'"),
        (PolicyConfig(params={"queueing_threshold_lora": "50"}), "'queueing_threshold_lora'"),
        (PolicyConfig(params={"queueing_threshold_lora": 5.5}), "'queueing_threshold_lora'"),
        (PolicyConfig(params={"queue_threshold_critical": True}), "'queue_threshold_critical'"),
        (PolicyConfig(params={"queue_threshold_critical": -1}), "'queue_threshold_critical'"),
        (PolicyConfig(params={"kv_cache_threshold": "high"}), "'kv_cache_threshold'"),
        (PolicyConfig(name="random", params={"seed": 1}), "unknown parameter 'seed'"),
        (PolicyConfig(name="round-robin", params={"x": 1}), "unknown parameter 'x'"),
        (PolicyConfig(name="least-queue", params={"x": 1}), "unknown parameter 'x'"),
    ],
)
def test_config_errors_name_the_problem(config, message) -> None:
    with pytest.raises(PolicyConfigError, match=message) as info:
        build_policy(config, random.Random(0))
    assert isinstance(info.value, ValueError)


def test_int_accepted_for_float_threshold() -> None:
    p = policy("filter-tree", kv_cache_threshold=1, queue_threshold_critical=100)
    req = SchedulingRequest(model="m", target_model="m", criticality=Criticality.SHEDDABLE)
    assert p.schedule(req, [pod("full", waiting=99, kv=1.0)]).pick is not None
