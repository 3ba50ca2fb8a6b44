"""The router scores prefixes from the precise index when the pool has a tokenizer and pods
publish KV events (pure: no network; the simulator's tokenizer stands in for the pool's)."""

from __future__ import annotations

import logging

import msgspec
import pytest

from scheduling.prefix_hash import prefix_hashes
from scheduling.prompt import Message, chat_prompt
from scheduling.prompt_tokenizers import SimTokenizer
from scheduling.token_blocks import block_keys, root_key
from services.picker.kv_blocks_feed import KVBlocksSink
from services.picker.routing import RequestFields
from shared.kv_blocks import KVBlockChanges, encode
from shared.kv_events import AllBlocksCleared, BlockStored
from shared.schemas import Criticality
from tests.test_picker_prompt_routing import SYSTEM, chat, prefix_fleet, routed
from tests.test_picker_routing import POOL, Fleet

BS = 16


def messages_of(system: str, question: str) -> list[Message]:
    return [Message("system", system), Message("user", question)]


def chat_ids(system: str, question: str) -> list[int]:
    """The token ids the simulator computes for ``chat(system, question)``."""
    ids = SimTokenizer().prompt_token_ids(None, messages_of(system, question))
    assert ids is not None
    return list(ids)


def store(fleet: Fleet, pod: str, ids: list[int], first_hash: int) -> None:
    """``pod``'s engine announces the full blocks of ``ids`` (its own hashes)."""
    blocks = len(ids) // BS
    fleet.router.precise.apply(KVBlockChanges(
        POOL, pod, fleet.pods.registered_address(pod) or "", 0, 0.0,
        [BlockStored(tuple(range(first_hash, first_hash + blocks)), None,
                     tuple(ids[:blocks * BS]), BS, None, "GPU")]))


def publishing_fleet(pods: int = 4) -> Fleet:
    """A prefix-aware pool whose pods all publish events (each caches some unrelated text)."""
    fleet = prefix_fleet(pods)
    fleet.router.tokenizer = SimTokenizer()
    for number in range(pods):
        store(fleet, f"pod-{number}", chat_ids(f"unrelated {number} " * 40, "x"),
              1000 * (number + 1))
    return fleet


def test_requests_go_to_the_pod_whose_events_show_the_prefix() -> None:
    fleet = publishing_fleet()
    for group, holder in enumerate(("pod-2", "pod-0", "pod-3")):
        system = f"[group {group}] " + SYSTEM
        store(fleet, holder, chat_ids(system, "warm-up"), 100_000 * (group + 1))
        for question in ("first", "second", "third"):
            result = routed(fleet, chat(system, question))
            assert result.pod == holder
            fleet.pods.finished(result.pod)


def test_hits_are_token_blocks_and_pods_without_events_keep_the_approximate_index() -> None:
    fleet = prefix_fleet(3)
    fleet.router.tokenizer = SimTokenizer()
    ids = chat_ids(SYSTEM, "q")
    store(fleet, "pod-0", ids, 1)  # pod-0 publishes events; pod-1 and pod-2 do not
    messages = messages_of(SYSTEM, "q")
    hashes = prefix_hashes(chat_prompt(messages).data, "chat")
    fleet.router.prefixes.record("pod-1", hashes[:2])  # believed to hold 2 of its 1 KiB blocks
    fleet.router.prefixes.record("pod-0", hashes)  # what pod-0's events say wins
    request, approximate, keys, block_tokens = fleet.router._request(
        b"", "chat", "chat", Criticality.STANDARD, RequestFields(model="chat", messages=messages))
    assert approximate == hashes
    assert keys == block_keys(ids, BS, root_key(None))
    assert request.prefix_hashes == tuple(keys)
    assert block_tokens == BS
    full = len(ids) // BS
    assert request.prefix_hits == {"pod-0": full,
                                   "pod-1": int(2 * len(keys) / len(hashes))}


def test_speculation_keeps_a_burst_of_one_prefix_together() -> None:
    fleet = publishing_fleet()
    system = "[burst] " + SYSTEM
    first = routed(fleet, chat(system, "a"))
    fleet.pods.started(first.pod, 1200)  # busier now, and no event has shown the prefix yet
    assert fleet.router.precise.match(block_keys(chat_ids(system, "a"), BS, root_key(None)))
    for question in ("b", "c"):
        assert routed(fleet, chat(system, question)).pod == first.pod


def test_without_speculation_a_busier_pod_loses_the_burst() -> None:
    """The counterpart of the test above: the first pick is busier and its events have not
    arrived, so without speculation the next request of the burst goes elsewhere."""
    fleet = publishing_fleet()
    fleet.router.precise.speculative_ttl = 0
    system = "[burst] " + SYSTEM
    first = routed(fleet, chat(system, "a"))
    fleet.pods.started(first.pod, 1200)
    assert routed(fleet, chat(system, "b")).pod != first.pod


def test_lora_targets_named_by_events_use_the_adapters_root() -> None:
    fleet = publishing_fleet()
    fleet.model("sql-lora")
    ids = chat_ids(SYSTEM, "q")
    # pod-1 caches the prompt under the adapter, pod-3 under the base model.
    fleet.router.precise.apply(KVBlockChanges(
        POOL, "pod-1", "127.0.0.1:8002", 0, 0.0,
        [BlockStored(tuple(range(50, 50 + len(ids) // BS)), None,
                     tuple(ids[:len(ids) // BS * BS]), BS, "sql-lora", "GPU")]))
    store(fleet, "pod-3", ids, 70)
    request = {"model": "sql-lora", "messages": chat(SYSTEM, "q")["messages"]}
    assert routed(fleet, request).pod == "pod-1"
    assert routed(fleet, chat(SYSTEM, "q")).pod == "pod-3"


def test_without_a_tokenizer_the_approximate_index_is_used_and_said_once(
        caplog: pytest.LogCaptureFixture) -> None:
    fleet = publishing_fleet()
    fleet.router.tokenizer = None
    with caplog.at_level(logging.INFO, logger="lig.picker.routing"):
        first = routed(fleet, chat(SYSTEM, "a"))
        second = routed(fleet, chat(SYSTEM, "b"))
    assert second.pod == first.pod  # the approximate index learnt from the first
    assert first.prefix_hashes == second.prefix_hashes != ()
    said = [record for record in caplog.records if "no tokenizer" in record.getMessage()]
    assert len(said) == 1


class BrokenTokenizer:
    def prompt_token_ids(self, prompt: object, messages: object) -> list[int]:
        raise RuntimeError("tokenizer file vanished")


class HugeIds:
    def prompt_token_ids(self, prompt: object, messages: object) -> list[int]:
        return [1 << 40] * 64


@pytest.mark.parametrize("tokenizer", [BrokenTokenizer(), HugeIds()])
def test_a_failing_tokenizer_falls_back_to_the_approximate_index(tokenizer: object) -> None:
    fleet = publishing_fleet()
    fleet.router.tokenizer = tokenizer  # type: ignore[assignment]
    first = routed(fleet, chat(SYSTEM, "a"))
    assert routed(fleet, chat(SYSTEM, "b")).pod == first.pod


def test_a_pod_leaving_the_pool_leaves_the_precise_index() -> None:
    fleet = publishing_fleet()
    current = fleet.view.endpoints[POOL]
    fleet.view.endpoints[POOL] = msgspec.structs.replace(current, endpoints=tuple(
        endpoint for endpoint in current.endpoints if endpoint.name in {"pod-0", "pod-1"}))
    fleet.router.update(fleet.view)
    assert fleet.router.precise.event_pods() == {"pod-0", "pod-1"}


def test_the_sink_applies_good_messages_and_counts_bad_ones() -> None:
    fleet = prefix_fleet(2)
    skipped: list[str] = []
    sink = KVBlocksSink(lambda pool: (fleet.router.precise, fleet.pods) if pool == POOL
                        else None, on_skip=skipped.append)
    ids = chat_ids(SYSTEM, "q")
    good = KVBlockChanges(POOL, "pod-0", "127.0.0.1:8001", 0, 0.0,
                          [BlockStored((1, 2), None, tuple(ids[:2 * BS]), BS)])
    sink.accept("lig.kvblocks.p.pod-0", encode(good))
    sink.accept("lig.kvblocks.p.pod-0", b"\x93garbage")
    sink.accept("lig.kvblocks.other.pod-0", encode(
        KVBlockChanges("other", "pod-0", "127.0.0.1:8001", 0, 0.0, [])))
    sink.accept("lig.kvblocks.p.pod-1", encode(
        KVBlockChanges(POOL, "pod-1", "10.9.9.9:1", 0, 0.0,
                       [BlockStored((3,), None, tuple(ids[:BS]), BS)])))
    assert skipped == ["undecodable", "pool", "address"]
    assert fleet.router.precise.event_pods() == {"pod-0"}
    assert len(fleet.router.precise) == 2


def test_a_flood_for_pods_the_registry_does_not_list_is_skipped() -> None:
    """Once the registry named the pool's members, changes of other pods are counted and
    dropped: a flood of invented pod names neither grows the index nor slows every lookup."""
    fleet = prefix_fleet(2)
    skipped: list[str] = []
    sink = KVBlocksSink(lambda pool: (fleet.router.precise, fleet.pods) if pool == POOL
                        else None, on_skip=skipped.append)
    ids = chat_ids(SYSTEM, "q")
    for number in range(500):
        sink.accept(f"lig.kvblocks.p.ghost-{number}", encode(KVBlockChanges(
            POOL, f"ghost-{number}", f"10.0.0.{number % 250}:1", number % 7, 0.0,
            [BlockStored((number,), None, tuple(ids[:BS]), BS)])))
    assert skipped == ["unknown"] * 500
    assert fleet.router.precise.event_pods() == set()
    assert fleet.router.precise.pods() == []
    assert len(fleet.router.precise) == 0


def test_changes_that_came_before_the_registry_are_kept_for_members_only() -> None:
    """Before the registry is read (a recording replayed at start-up) every pod's changes are
    applied; the first membership drops the pods that are not members, long-gone ones too."""
    fleet = Fleet()
    sink = KVBlocksSink(lambda pool: (fleet.router.precise, fleet.pods) if pool == POOL
                        else None)
    ids = chat_ids(SYSTEM, "q")
    for pod in ("pod-0", "gone-long-ago"):
        sink.accept(f"lig.kvblocks.p.{pod}", encode(KVBlockChanges(
            POOL, pod, "127.0.0.1:8001", 0, 0.0,
            [BlockStored((1,), None, tuple(ids[:BS]), BS)])))
    assert fleet.router.precise.event_pods() == {"pod-0", "gone-long-ago"}
    fleet.pod("pod-0", 8001)
    assert fleet.router.precise.event_pods() == {"pod-0"}
    assert fleet.router.precise.pods() == ["pod-0"]
    assert len(fleet.router.precise) == 1


def test_changes_of_an_impossible_rank_are_undecodable() -> None:
    """vLLM's data-parallel ranks are what lig kv-events accepts from it (0..65,535): a message
    naming another is garbage, not a new rank kept forever in the index."""
    fleet = prefix_fleet(1)
    skipped: list[str] = []
    sink = KVBlocksSink(lambda pool: (fleet.router.precise, fleet.pods) if pool == POOL
                        else None, on_skip=skipped.append)
    for rank in (-1, 1 << 16, 1 << 40):
        sink.accept("lig.kvblocks.p.pod-0", encode(KVBlockChanges(
            POOL, "pod-0", "127.0.0.1:8001", 0, 0.0, [], dp_rank=rank)))
    sink.accept("lig.kvblocks.p.pod-0", encode(KVBlockChanges(
        POOL, "pod-0", "127.0.0.1:8001", 0, 0.0, [], dp_rank=(1 << 16) - 1)))
    assert skipped == ["undecodable"] * 3
    assert fleet.router.precise.stats.messages == 1


def test_a_pod_with_incomplete_events_gets_the_better_of_both_indexes() -> None:
    """Once the bridge resynced pod-0 (its events lost), its precise state is partial: the
    approximate index's belief counts for it too, until the recovery time has passed."""
    fleet = prefix_fleet(2)
    fleet.router.tokenizer = SimTokenizer()
    ids = chat_ids(SYSTEM, "q")
    store(fleet, "pod-0", ids, 1)
    store(fleet, "pod-1", chat_ids("unrelated " * 40, "x"), 5000)
    messages = messages_of(SYSTEM, "q")
    hashes = prefix_hashes(chat_prompt(messages).data, "chat")
    fleet.router.prefixes.record("pod-0", hashes)

    def hits() -> dict[str, int]:
        request, _, _, _ = fleet.router._request(
            b"", "chat", "chat", Criticality.STANDARD,
            RequestFields(model="chat", messages=messages))
        return dict(request.prefix_hits)

    full = hits()["pod-0"]
    assert full == len(ids) // BS
    fleet.router.precise.apply(KVBlockChanges(
        POOL, "pod-0", fleet.pods.registered_address("pod-0") or "", -1, 0.0,
        [AllBlocksCleared()], resync=True))
    assert fleet.router.precise.incomplete_pods() == {"pod-0"}
    # Its events were cleared; the routing history still says it holds the prompt.
    assert hits().get("pod-0") == full
