"""The router reads prompts: token estimate, prefix hashes, the pool's prefix index, token load."""

from __future__ import annotations

import msgspec
import pytest

from scheduling.prefix_hash import prefix_hashes
from scheduling.prompt import chat_prompt
from services.picker.routing import Routed, read_request
from shared.schemas import Endpoint, EndpointSet, PodMetrics, PolicyConfig
from tests.test_picker_routing import POOL, Fleet

SYSTEM = "You answer questions about the fleet. " * 120  # ~4,700 characters


def chat(system: str, question: str, **extra: object) -> dict:
    return {"model": "chat", "messages": [{"role": "system", "content": system},
                                          {"role": "user", "content": question}], **extra}


def prefix_fleet(pods: int = 4) -> Fleet:
    """A prefix-aware pool of idle pods, every one with a fresh snapshot at its address."""
    fleet = Fleet(policy=PolicyConfig("prefix-aware")).model("chat")
    endpoints = tuple(Endpoint(f"pod-{i}", "127.0.0.1", 8001 + i) for i in range(pods))
    fleet.view.endpoints[POOL] = EndpointSet(pool=POOL, endpoints=endpoints)
    fleet.router.update(fleet.view)
    for seq, endpoint in enumerate(endpoints, start=1):
        fleet.pods.apply(PodMetrics(pool=POOL, pod=endpoint.name, address=endpoint.hostport,
                                    seq=seq, scrape_time_ns=seq, scrape_duration_s=0.0, ok=True))
    assert len(fleet.pods.fresh_views()) == pods
    return fleet


def routed(fleet: Fleet, document: object) -> Routed:
    result = fleet.route(document)
    assert isinstance(result, Routed), result
    return result


def test_routed_requests_carry_prompt_tokens_limit_and_hashes() -> None:
    fleet = prefix_fleet()
    result = routed(fleet, chat(SYSTEM, "how many pods?", max_completion_tokens=64,
                                max_tokens=999))
    messages = msgspec.json.decode(msgspec.json.encode(chat(SYSTEM, "how many pods?"))
                                   )["messages"]
    assert result.prompt_tokens > 1000
    assert result.max_tokens == 64
    from scheduling.prompt import Message
    digest = chat_prompt([Message(m["role"], m["content"]) for m in messages])
    assert result.prefix_hashes == prefix_hashes(digest.data, "chat")
    assert routed(fleet, {"model": "chat", "prompt": "hi", "max_tokens": 5}).max_tokens == 5


def test_same_system_prompt_sticks_to_one_pod_and_others_spread() -> None:
    """The index learns from routing: the second request with a prefix goes where the first
    went, while new prefixes go to other (less loaded) pods."""
    fleet = prefix_fleet()
    homes = {}
    for group in range(4):
        system = f"[group {group}] " + SYSTEM
        homes[group] = routed(fleet, chat(system, "first")).pod
        fleet.pods.started(homes[group], 1200)  # as the gateway counts it
    assert len(set(homes.values())) == 4  # token load spread the new prefixes
    for group in range(4):
        system = f"[group {group}] " + SYSTEM
        for question in ("second", "third"):
            assert routed(fleet, chat(system, question)).pod == homes[group]


def test_prefix_hits_are_handed_to_the_policy() -> None:
    fleet = prefix_fleet()
    first = routed(fleet, chat(SYSTEM, "a"))
    hits = fleet.router.prefixes.match(first.prefix_hashes)
    assert hits == {first.pod: len(first.prefix_hashes)}


def test_a_pod_leaving_the_pool_is_forgotten_by_the_index() -> None:
    fleet = prefix_fleet()
    first = routed(fleet, chat(SYSTEM, "a"))
    endpoints = fleet.view.endpoints[POOL].endpoints
    fleet.view.endpoints[POOL] = EndpointSet(
        pool=POOL, endpoints=tuple(e for e in endpoints if e.name != first.pod))
    fleet.router.update(fleet.view)
    assert first.pod not in fleet.router.prefixes.pods()
    assert routed(fleet, chat(SYSTEM, "b")).pod != first.pod


def test_unreported_tokens_reach_the_views() -> None:
    fleet = prefix_fleet()
    result = routed(fleet, {"model": "chat", "prompt": "x" * 32_000})
    fleet.pods.started(result.pod, result.prompt_tokens)
    views = {view.name: view for view in fleet.pods.fresh_views()}
    assert views[result.pod].unreported_tokens == 8000
    fleet.pods.served_elsewhere(result.pod, "pod-3" if result.pod != "pod-3" else "pod-0",
                                result.prompt_tokens)
    views = {view.name: view for view in fleet.pods.fresh_views()}
    assert views[result.pod].unreported_tokens == 0
    assert sum(view.unreported_tokens for view in views.values()) == 8000


@pytest.mark.parametrize("document", [
    {"model": "chat", "messages": 5},
    {"model": "chat", "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
    {"model": "chat", "prompt": {"not": "a prompt"}},
    {"model": "chat", "prompt": "x", "max_tokens": 1.5},
])
def test_odd_prompt_fields_are_routed_on_the_model_alone(document: dict) -> None:
    """Prompt fields of an unexpected shape are the model server's to refuse, not the picker's
    (as before it read prompts): routed, no prompt estimate."""
    fleet = prefix_fleet()
    result = routed(fleet, document)
    assert (result.prompt_tokens, result.max_tokens, result.prefix_hashes) == (0, 0, ())


def test_odd_but_decodable_prompts_are_estimated_and_limits_bounded() -> None:
    """A batch mixing ids and text is counted (no hashes: its first item is not a prompt of
    ids only); a completion limit beyond 32 bits is clamped so that events carrying it encode."""
    fleet = prefix_fleet()
    result = routed(fleet, {"model": "chat", "prompt": [1, "mixed", [2]],
                            "max_completion_tokens": 10**30})
    assert (result.prompt_tokens, result.prefix_hashes) == (3, ())
    assert result.max_tokens == 2**31 - 1
    assert routed(fleet, {"model": "chat", "prompt": "x", "max_tokens": -5}).max_tokens == 0


def test_a_rewrite_keeps_messages_byte_for_byte() -> None:
    fleet = prefix_fleet(1).model("alias", targets={"real": 1})
    raw = (b'{"messages":[{"role":"user","content":[{"type":"text","text":"h\\u00e9"}]}],'
           b'"model":"alias","max_tokens":1e400}')
    result = fleet.router.route(raw)
    assert isinstance(result, Routed) and result.body is not None
    assert result.body == raw.replace(b'"alias"', b'"real"')


def test_read_request_keeps_the_400s() -> None:
    assert read_request(b"not json").status == 400  # type: ignore[union-attr]
    assert read_request(b'{"messages": []}').status == 400  # type: ignore[union-attr]
    assert read_request(b'{"model": 1, "prompt": "x"}').status == 400  # type: ignore[union-attr]
