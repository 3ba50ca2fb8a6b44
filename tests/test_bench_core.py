"""``lig bench`` on the picker's shipping core: request bodies, ``default``, ``+oracle``, shared
decisions, the multi-turn workload and the one event loop."""

from __future__ import annotations

import argparse
import random

import msgspec
import pytest

from scheduling_bench.fleet import FleetConfig, Outcome, simulate
from scheduling_bench.runner import Point, engine_config, parse_policy, run_point
from scheduling_bench.workloads import WORKLOADS, generate
from services.picker import main as picker_main
from services.picker.settings import PickerSettings
from shared.schemas import PolicyConfig
from simulator.engine import Engine, EngineConfig
from simulator.profiles import DEFAULT_PROFILE, PROFILES
from simulator.virtual_time import ARRIVAL, DELIVERY, SCRAPE, EventLoop, VirtualClock


class Message(msgspec.Struct):
    role: str
    content: str


class ChatBody(msgspec.Struct):
    model: str
    messages: list[Message]
    max_tokens: int


def point(workload: str, label: str, rate: float, duration: float, **fields) -> Point:
    return Point(WORKLOADS[workload], **parse_policy(label).fields(), rate=rate,
                 duration=duration, **fields)


def test_requests_are_openai_bodies_whose_shared_prefix_is_in_the_text() -> None:
    requests = generate(WORKLOADS["shared-prefix"], 50, 10, seed=1)
    bodies = [msgspec.json.decode(r.body(), type=ChatBody) for r in requests]
    by_group: dict[tuple[int, int], set[str]] = {}
    for request, body in zip(requests, bodies, strict=True):
        assert [m.role for m in body.messages] == ["system", "user"]
        assert body.max_tokens == request.spec.max_tokens and body.model == request.model
        # One word per token of the engine's segment.
        assert len(body.messages[1].content.split()) == request.spec.prompt.segments[1][1]
        by_group.setdefault(request.spec.prompt.segments[0], set()).add(body.messages[0].content)
    assert all(len(texts) == 1 for texts in by_group.values())  # a group shares its text
    assert len({next(iter(texts)) for texts in by_group.values()}) == len(by_group)
    assert len({body.messages[1].content[:40] for body in bodies}) == len(bodies)
    trace_like = msgspec.structs.replace(WORKLOADS["chat"], chat=False)
    completion = msgspec.json.decode(generate(trace_like, 5, 2, seed=1)[0].body())
    assert isinstance(completion["prompt"], str) and "messages" not in completion


def test_default_is_the_policy_and_settings_lig_picker_runs_without_flags() -> None:
    choice = parse_policy("default")
    assert choice.policy == PolicyConfig() and choice.alias == "default" and not choice.oracle
    oracle = parse_policy("default+oracle")
    assert oracle.oracle and oracle.load_estimate and oracle.policy == PolicyConfig()
    raw = parse_policy("filter-tree+raw+oracle")
    assert raw.oracle and not raw.load_estimate and raw.policy.name == "filter-tree"
    # The bench builds each replica from lig picker's own settings, defaults but for its pool.
    parser = argparse.ArgumentParser()
    picker_main.configure(parser)
    flags = picker_main.settings_from(parser.parse_args([]))
    assert msgspec.structs.replace(flags, pools=[]) == PickerSettings()
    assert run_point(point("chat", "default", 40, 2)).policy == "default"


def test_the_oracle_decides_on_exact_state_when_snapshots_never_arrive() -> None:
    """Without snapshots the filter tree cannot see overload (it never sheds); with the exact
    state at each decision it sheds sheddable requests, and only those."""
    stale = run_point(point("mixed-criticality", "filter-tree", 450, 4, propagation_delay=1e6))
    exact = run_point(point("mixed-criticality", "filter-tree+oracle", 450, 4,
                            propagation_delay=1e6))
    assert stale.shed == 0
    assert exact.policy == "filter-tree+oracle"
    assert exact.shed > 0.1 * exact.by_criticality["Sheddable"].requests
    assert exact.shed == exact.by_criticality["Sheddable"].shed


def test_multi_turn_prompts_grow_by_the_conversation_and_turns_wait_for_answers() -> None:
    workload = WORKLOADS["multi-turn"]
    requests = generate(workload, 60, 10, seed=2)
    assert sum(r.after < 0 for r in requests) == pytest.approx(10 * 60 / workload.turns, rel=0.3)
    for index, request in enumerate(requests):
        if request.after < 0:
            continue
        previous = requests[request.after]
        assert previous.then == index
        body = msgspec.json.decode(request.body(), type=ChatBody)
        before = msgspec.json.decode(previous.body(), type=ChatBody)
        # The whole conversation so far (the answer as an assistant message), then a new message.
        assert body.messages[: len(before.messages)] == before.messages
        assert [m.role for m in body.messages[len(before.messages):]] == ["assistant", "user"]
        assert len(body.messages[-2].content.split()) == previous.spec.max_tokens
    config = FleetConfig(pods=1, engine=engine_config(workload, PROFILES[DEFAULT_PROFILE]))
    run = simulate(requests, PolicyConfig(name="round-robin"), config, seed=2)
    assert set(run.outcomes) == {Outcome.COMPLETED}
    for request, record in zip(requests, run.records, strict=True):
        if request.after >= 0:
            answered = run.records[request.after].finish_time
            assert record.arrival_time == pytest.approx(answered + request.think)
    # On one pod every turn finds its conversation's earlier prompt in the prefix cache.
    computed = sum(r.num_prompt_tokens - r.num_cached_tokens for r in run.records)
    assert computed < 0.6 * sum(r.num_prompt_tokens for r in run.records)


def test_multi_turn_reports_prompt_tokens_computed_per_policy() -> None:
    metrics = run_point(point("multi-turn", "round-robin", 60, 6))
    assert 0 < metrics.computed_prompt_tokens < metrics.prompt_tokens


def test_replicas_share_their_decisions_through_the_core() -> None:
    """With the decision stream (``Gateway.apply_peer``) each replica applies the others'
    decisions ``decision_delay`` later; without it replicas count only their own."""
    shared = run_point(point("chat", "default", 180, 3, pickers=4))
    alone = run_point(point("chat", "default", 180, 3, pickers=4, shared_decisions=False))
    assert shared.shared_decisions and shared.decision_delay == 0.002
    assert not alone.shared_decisions
    assert shared.ttft != alone.ttft


def test_one_event_loop_orders_steps_scrapes_deliveries_and_arrivals_at_an_instant() -> None:
    clock = VirtualClock()
    engine = Engine(EngineConfig(), clock, random.Random(1))
    seen: list[str] = []
    loop = EventLoop([engine], clock, lambda pod, result: seen.append("step"))

    def note(now: float, what: str) -> None:
        seen.append(f"{what}@{now:g}")
        if what == "arrival":
            loop.at(now, DELIVERY, note, "same-instant delivery")

    loop.at(1.0, ARRIVAL, note, "arrival")
    loop.at(1.0, DELIVERY, note, "delivery")
    loop.at(1.0, SCRAPE, note, "scrape")
    loop.at(0.5, ARRIVAL, note, "early")
    loop.run()
    assert seen == ["early@0.5", "scrape@1", "delivery@1", "arrival@1",
                    "same-instant delivery@1"]
    assert clock.now() == 1.0
