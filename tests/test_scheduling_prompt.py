"""Prompt-aware scheduling, pure logic: token estimate, prefix hashes, prefix index, token load,
the new scorers and scheduler profiles (``prefix-aware``)."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from scheduling import PolicyConfigError, build_policy
from scheduling.prefix_hash import BLOCK_BYTES, MAX_BLOCKS, prefix_hashes
from scheduling.prefix_index import PrefixIndex
from scheduling.prompt import (
    MESSAGE_OVERHEAD_TOKENS,
    ContentPart,
    Message,
    chat_prompt,
    completion_prompt,
    text_tokens,
)
from scheduling.types import PodView, SchedulingRequest
from services.picker.load_estimate import UnreportedLoad, picker_views
from services.picker.observability import PickerMetrics
from shared.schemas import Criticality, PolicyConfig

LONG = "You are a careful assistant. " * 600  # ~17,400 characters


# --- token estimate ------------------------------------------------------------------------

def test_text_is_one_token_per_four_characters_rounded_up() -> None:
    assert [text_tokens(n) for n in (0, 1, 4, 5, 16_000)] == [0, 1, 1, 2, 4000]
    assert completion_prompt("x" * 16_000).tokens == 4000
    assert completion_prompt(None).tokens == 0


def test_token_ids_and_batches_count_every_prompt() -> None:
    assert completion_prompt([1, 2, 3]).tokens == 3
    assert completion_prompt([[1, 2], [3, 4, 5]]).tokens == 5
    assert completion_prompt(["abcd", "abcdefgh"]).tokens == 3


def test_chat_counts_the_whole_message_list_with_parts() -> None:
    messages = [
        Message("system", "s" * 400),
        Message("user", [ContentPart("text", "u" * 40), ContentPart("image_url", None)]),
        Message("assistant", None),
        Message("user", "q" * 8),
    ]
    digest = chat_prompt(messages)
    assert digest.tokens == 100 + 10 + 0 + 2 + 4 * MESSAGE_OVERHEAD_TOKENS
    only_first = chat_prompt(messages[:1])
    assert digest.tokens > only_first.tokens


# --- prefix hashes -------------------------------------------------------------------------

def test_hashes_are_chained_over_full_blocks_and_bounded() -> None:
    data = LONG.encode()
    hashes = prefix_hashes(data, "m")
    assert len(hashes) == len(data) // BLOCK_BYTES
    assert prefix_hashes(data[:BLOCK_BYTES - 1], "m") == ()
    # Same leading blocks, same leading hashes; a change in block 0 changes every hash after it.
    assert prefix_hashes(data[:3 * BLOCK_BYTES] + b"other", "m") == hashes[:3]
    changed = prefix_hashes(b"X" + data[1:], "m")
    assert all(a != b for a, b in zip(changed, hashes, strict=True))
    assert len(prefix_hashes(b"y" * BLOCK_BYTES * (MAX_BLOCKS + 5), "m")) == MAX_BLOCKS


def test_hashes_depend_on_the_target_model() -> None:
    data = LONG.encode()
    assert prefix_hashes(data, "base")[0] != prefix_hashes(data, "adapter-1")[0]


def test_chat_hashes_cover_every_message_with_its_role() -> None:
    system = Message("system", "s" * 2000)
    first = chat_prompt([system, Message("user", "a" * 2000)])
    follow_up = chat_prompt([system, Message("user", "a" * 2000),
                             Message("assistant", "b" * 700), Message("user", "c" * 900)])
    other_role = chat_prompt([Message("user", "s" * 2000), Message("user", "a" * 2000)])
    h_first, h_follow = prefix_hashes(first.data, "m"), prefix_hashes(follow_up.data, "m")
    assert len(h_follow) > len(h_first)
    assert h_follow[:len(h_first)] == h_first  # a conversation extends its own prefix
    assert prefix_hashes(other_role.data, "m")[0] != h_first[0]


# --- prefix index --------------------------------------------------------------------------

def test_match_counts_leading_blocks_per_pod() -> None:
    index = PrefixIndex(100)
    index.record("a", [1, 2, 3, 4])
    index.record("b", [1, 2, 9])
    assert index.match([1, 2, 3, 4, 5]) == {"a": 4, "b": 2}
    assert index.match([1, 2, 9]) == {"a": 2, "b": 3}
    assert index.match([7, 1, 2]) == {}


def test_index_is_lru_bounded_and_a_pod_needs_every_earlier_block() -> None:
    index = PrefixIndex(4)
    index.record("a", [1, 2, 3])
    index.record("b", [10, 11])  # evicts 1: the oldest
    assert len(index) == 4
    assert index.match([1, 2, 3]) == {}
    index.record("a", [2])  # 2 is now the newest
    index.record("c", [20, 21])  # evicts 3 and 10
    assert index.match([2]) == {"a": 1}
    assert index.match([10, 11]) == {}
    assert PrefixIndex(0).match([1]) == {}


def test_the_picker_exports_each_pools_entries() -> None:
    index = PrefixIndex(4)
    index.record("a", [1, 2, 3, 4, 5])
    prometheus = CollectorRegistry()
    metrics = PickerMetrics(prometheus)
    metrics.prefix.indexes = lambda: {"pool": index}
    assert prometheus.get_sample_value("lig_picker_prefix_index_entries", {"pool": "pool"}) == 4


def test_forget_drops_a_pod_everywhere() -> None:
    index = PrefixIndex(100)
    index.record("a", [1, 2])
    index.record("b", [1, 3])
    index.forget("a")
    assert index.match([1, 2]) == {"b": 1}
    assert index.pods() == {"b"}
    assert len(index) == 2


# --- token load ----------------------------------------------------------------------------

def test_unreported_tokens_are_counted_until_the_next_snapshot() -> None:
    load = UnreportedLoad()
    for _ in range(3):
        load.routed("big", 8000)
        load.routed("small", 50)
    load.routed("big")
    assert dict(load.tokens) == {"big": 24_000, "small": 150}
    load.unrouted("small", 50)
    assert load.tokens["small"] == 100
    load.reported("big")
    assert "big" not in load.tokens and "big" not in load.counts
    views = picker_views([PodView("big", "x"), PodView("small", "y")], {}, load.counts,
                         load.tokens)
    assert [v.unreported_tokens for v in views] == [0, 100]
    disabled = UnreportedLoad(enabled=False)
    disabled.routed("big", 8000)
    assert not disabled.tokens


def prefix_aware(**params: object):
    return build_policy(PolicyConfig("prefix-aware", params), random.Random(3))


def request(**fields: object) -> SchedulingRequest:
    return SchedulingRequest("m", "m", **fields)  # type: ignore[arg-type]


def test_token_load_tells_big_prompts_from_small_ones() -> None:
    """Three 8,000-token prompts are not three 50-token prompts (same request counts)."""
    pods = [PodView("big", "1", unreported_tokens=24_000),
            PodView("small", "2", unreported_tokens=150)]
    policy = prefix_aware(scorers=[{"plugin": "token_load"}])
    picks = {policy.schedule(request(), pods).pick.name for _ in range(20)}  # type: ignore[union-attr]
    assert picks == {"small"}
    scores = policy.schedule(request(), pods, explain=True).scores
    by_pod = {entry.pod: entry.scores["token_load"] for entry in scores}
    assert by_pod["small"] > 0.95 and by_pod["big"] < 0.2


# --- scorers and profiles ------------------------------------------------------------------

def test_the_pod_with_the_longer_prefix_wins_within_the_load_margin() -> None:
    pods = [PodView("a", "1", waiting=0), PodView("b", "2", waiting=3),
            PodView("c", "3", waiting=0)]
    hits = request(prefix_hashes=(1, 2, 3, 4), prefix_hits={"b": 4, "c": 1})
    policy = prefix_aware()
    assert {policy.schedule(hits, pods).pick.name for _ in range(20)} == {"b"}  # type: ignore[union-attr]
    # Beyond the margin the prefix stops counting: the hot pod is not melted.
    busy = [PodView("a", "1", waiting=0), PodView("b", "2", waiting=9),
            PodView("c", "3", waiting=0)]
    picks = {prefix_aware().schedule(hits, busy).pick.name for _ in range(20)}  # type: ignore[union-attr]
    assert "b" not in picks
    assert {prefix_aware(scorers=[{"plugin": "prefix_affinity", "params": {"load_margin": 20}}])
            .schedule(hits, busy).pick.name for _ in range(5)} == {"b"}  # type: ignore[union-attr]


def test_only_sheddable_requests_are_shed() -> None:
    saturated = [PodView("a", "1", waiting=50, kv_cache_usage=0.95)]
    policy = prefix_aware()
    shed = policy.schedule(request(criticality=Criticality.SHEDDABLE), saturated)
    assert (shed.pick, shed.shed) == (None, True)
    for criticality in (Criticality.CRITICAL, Criticality.STANDARD):
        decision = policy.schedule(request(criticality=criticality), saturated)
        assert decision.pick is not None and not decision.shed
    roomy = [*saturated, PodView("b", "2", waiting=1)]
    assert policy.schedule(request(criticality=Criticality.SHEDDABLE), roomy).pick.name == "b"  # type: ignore[union-attr]


def test_lora_fit_prefers_the_active_adapter_then_a_free_slot() -> None:
    pods = [PodView("full", "1", running_adapters=frozenset({"x", "y"}), max_lora=2),
            PodView("room", "2", running_adapters=frozenset({"x"}), max_lora=2),
            PodView("has", "3", running_adapters=frozenset({"t", "y"}), max_lora=2)]
    adapter = SchedulingRequest("t", "t")
    policy = prefix_aware(scorers=[{"plugin": "lora_fit"}])
    assert policy.schedule(adapter, pods).pick.name == "has"  # type: ignore[union-attr]
    scores = {s.pod: s.total for s in policy.schedule(adapter, pods, explain=True).scores}
    assert scores == {"full": 0.0, "room": 0.5, "has": 1.0}


def test_queue_and_kv_scorers_scale_to_0_1() -> None:
    pods = [PodView("a", "1", waiting=2, kv_cache_usage=0.25),
            PodView("b", "2", waiting=6, kv_cache_usage=1.5)]
    policy = prefix_aware(scorers=[{"plugin": "queue_load"}, {"plugin": "kv_cache_load",
                                                              "weight": 2}])
    scores = {s.pod: s.scores for s in policy.schedule(request(), pods, explain=True).scores}
    assert scores == {"a": {"queue_load": 1.0, "kv_cache_load": 0.75},
                      "b": {"queue_load": 0.0, "kv_cache_load": 0.0}}


def test_a_filter_that_keeps_nothing_passes_its_input_on() -> None:
    pods = [PodView("a", "1", running_adapters=frozenset({"x"}), max_lora=1)]
    policy = prefix_aware(filters=[{"plugin": "can_accept_lora"}],
                          scorers=[{"plugin": "queue_load"}])
    decision = policy.schedule(request(), pods, explain=True)
    assert decision.pick is not None and decision.pick.name == "a"
    assert decision.steps[0].branch == "passed input on"


@pytest.mark.parametrize("params, message", [
    ({"scorers": []}, "at least one scorer"),
    ({"scorers": [{"plugin": "random"}]}, "is a picker"),
    ({"filters": [{"plugin": "waiting"}]}, "is a scorer"),
    ({"picker": "least_queue"}, "is a filter"),
    ({"scorers": [{"plugin": "prefix_affinity", "weight": -1}]}, "scorers"),
    ({"scorers": [{"plugin": "token_load", "params": {"token_scale": 0}}]}, "token_scale"),
    ({"scorers": [{"plugin": "nope"}]}, "unknown plugin type"),
    ({"scorer": []}, "unknown parameter"),
])
def test_bad_profiles_are_refused_with_a_message(params: dict, message: str) -> None:
    with pytest.raises(PolicyConfigError, match=message):
        prefix_aware(**params)


def test_prefix_aware_is_the_default() -> None:
    from scheduling import policy_names

    assert policy_names()[0] == "prefix-aware" == PolicyConfig().name


def test_a_huge_prompt_is_counted_whole_but_hashed_only_as_far_as_needed() -> None:
    from scheduling.prompt import HASHED_BYTES

    huge = "z" * (HASHED_BYTES * 4)
    assert completion_prompt(huge).tokens == HASHED_BYTES
    assert len(completion_prompt(huge).data) == HASHED_BYTES
    chat = chat_prompt([Message("user", huge), Message("user", huge)])
    assert chat.tokens == 2 * HASHED_BYTES + 2 * MESSAGE_OVERHEAD_TOKENS
    assert len(chat.data) == HASHED_BYTES
    assert len(completion_prompt(list(range(HASHED_BYTES))).data) == HASHED_BYTES
    # Truncation never changes the hashes: they cover at most HASHED_BYTES anyway.
    full = ("ab" * HASHED_BYTES).encode()
    assert prefix_hashes(completion_prompt("ab" * HASHED_BYTES).data, "m") == prefix_hashes(
        full, "m")
