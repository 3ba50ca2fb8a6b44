"""Prefix affinity end to end: real nats-server, real Envoy, a real picker process, real HTTP
upstreams. Chat requests that share a long system prompt go to the pod that got the first one
(the picker's prefix index learned it from routing), new prefixes spread over the pods, and a
prefix's pod that becomes busy beyond the load margin stops attracting it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.schemas import PolicyConfig
from tests.test_picker_e2e import BUSY, IDLE, Stack, build_stack

pytestmark = pytest.mark.process  # real NATS, Envoy, picker and upstream processes

# Random draws judged on a sample. A new prefix goes to an idle pod, at random at worst (4
# pods; the picker's unreported count usually steers it off the pod it just used). "Prefixes
# spread over pods": all GROUPS first picks on one pod has P = 4 ** (1 - GROUPS), 1e-3 with the
# 6 groups used before, 6.0e-8 with 13. The control's "at least half the groups scattered" (a
# group of 4 questions lands on one pod with P = 1/64) fails with P = 8.7e-7 on 6 groups,
# 4.3e-12 on 13.
GROUPS = 13
QUESTIONS = 4
SYSTEM = "You are the support assistant of fleet {group}; answer briefly and cite the manual. "


def system_prompt(group: int) -> str:
    return (SYSTEM.format(group=group) * 50)[:4000]  # ~1,000 tokens, 7 hashed blocks


def ask(stack: Stack, group: int, question: str) -> str:
    """Send one chat request through Envoy; the name of the pod that served it."""
    body = {"model": "plain", "max_tokens": 8, "messages": [
        {"role": "system", "content": system_prompt(group)},
        {"role": "user", "content": question}]}
    response = stack.client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.headers["x-upstream"]


def current_policy(stack: Stack) -> str:
    """The policy the picker logged it switched to last; the default before any switch."""
    switches = [line for line in stack.pickers[0].log().splitlines() if "using policy " in line]
    return switches[-1].rsplit("using policy ", 1)[1].strip() if switches else PolicyConfig().name


def use_policy(stack: Stack, name: str) -> None:
    stack.reset(policy=PolicyConfig(name))
    stack.settle(lambda: current_policy(stack) == name, f"policy {name}")
    stack.settle(stack.all_fresh, "every pod fresh")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    built = build_stack(Path(tmp_path_factory.mktemp("prefix-e2e")), pods=4)
    try:
        yield built
    finally:
        built.close()


def test_requests_sharing_a_system_prompt_go_to_one_pod(stack: Stack) -> None:
    use_policy(stack, "prefix-aware")
    served: dict[int, list[str]] = {}
    for group in range(GROUPS):
        served[group] = [ask(stack, group, f"question {n} of group {group}?")
                         for n in range(QUESTIONS)]
    for group, pods in served.items():
        assert len(set(pods)) == 1, (group, pods)
    assert len({pods[0] for pods in served.values()}) >= 2  # prefixes spread over pods


def test_the_filter_tree_ignores_prompts(stack: Stack) -> None:
    """Control: the seed's policy spreads each group over the idle pods (what the prefix-aware
    test would see without the index)."""
    use_policy(stack, "filter-tree")
    scattered = 0
    for group in range(GROUPS):
        pods = [ask(stack, group + 100, f"question {n}?") for n in range(QUESTIONS)]
        scattered += len(set(pods)) > 1
    assert scattered >= GROUPS // 2


def test_a_busy_prefix_pod_stops_attracting_its_prefix(stack: Stack) -> None:
    use_policy(stack, "prefix-aware")
    home = ask(stack, 200, "first?")
    assert ask(stack, 200, "second?") == home
    assert stack.feed is not None
    stack.feed.set_many({u.name: (u.address, dict(BUSY if u.name == home else IDLE))
                         for u in stack.upstreams})
    stack.settle(lambda: ask(stack, 200, "probe?") != home, "busy pod left for the prefix")
    assert home not in {ask(stack, 200, f"later {n}?") for n in range(QUESTIONS)}
