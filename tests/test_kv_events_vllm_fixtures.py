"""What vLLM 0.33's own code sends, decoded: payloads encoded by vLLM's event classes and the
frames its replay socket sent, recorded by ``bench/check_vllm_kv_events.py --write-fixtures``
(which also runs vLLM's publisher against ``lig kv-events`` live, given a vLLM wheel)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from scheduling.precise_index import PreciseIndex
from scheduling.token_blocks import block_keys, root_key
from services.kvevents.pod_stream import replay_reply
from shared.kv_blocks import KVBlockChanges
from shared.kv_events import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, KVEventDecoder

FIXTURES = Path(__file__).parent / "fixtures" / "vllm_kv_events"
BLOCK = 16


def fixture(hashes: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"batches_{hashes}.json").read_text())


def decoded(hashes: str, decoder: KVEventDecoder | None = None) -> list[list[Any]]:
    decoder = decoder or KVEventDecoder()
    batches = []
    for seq, payload in enumerate(fixture(hashes)["payloads"]):
        batch = decoder.decode_payload(seq, bytes.fromhex(payload))
        assert batch is not None and not batch.skipped_events, decoder.skipped
        assert batch.dp_rank == 0 and batch.ts == 1_700_000_000.0
        batches.append(batch.events)
    assert not decoder.skipped
    return batches


@pytest.mark.parametrize("hashes", ["int", "bytes"])
def test_every_event_vllm_encodes_decodes_with_its_group_kind_and_adapter(hashes: str) -> None:
    batches = decoded(hashes)
    assert len(batches) == 7
    for number, events in enumerate(batches):
        first, second, window, removed = events[:4]
        assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
        assert isinstance(window, BlockStored) and isinstance(removed, BlockRemoved)
        # The chain: the second event's parent is the first's last block.
        assert second.parent_block_hash == first.block_hashes[-1]
        assert window.block_hashes == first.block_hashes + second.block_hashes
        assert (first.group_idx, first.kind) == (0, "full_attention")
        assert (window.group_idx, window.kind) == (1, "sliding_window")
        assert (removed.group_idx, removed.block_hashes) == (1, first.block_hashes[:1])
        assert first.token_ids == tuple(range(number * 100, number * 100 + 2 * BLOCK))
        # Named adapter; an adapter sent by id alone; the base model.
        assert first.lora_name == {1: "sql-lora", 2: "lora-id:2", 0: None}[number % 3]
        assert events[4:] == ([AllBlocksCleared()] if number == 6 else [])


def test_an_adapter_sent_by_id_alone_takes_its_configured_name() -> None:
    batches = decoded("int", KVEventDecoder(lora_names={2: "chat-lora"}))
    assert [events[0].lora_name for events in batches[:3]] == [None, "sql-lora", "chat-lora"]


def test_both_hash_types_keep_the_same_chain() -> None:
    """32-byte digests are folded to uint64, consistently: parents and removals still find
    their blocks."""
    for events in decoded("bytes"):
        first, second, window, removed = events[:4]
        assert second.parent_block_hash == first.block_hashes[-1]
        assert removed.block_hashes[0] in window.block_hashes


@pytest.mark.parametrize("hashes", ["int", "bytes"])
def test_vllms_replay_replies_carry_the_topic_frame_and_are_read(hashes: str) -> None:
    """vLLM 0.26 and later: ``["", topic, seq, payload]`` per batch, ``["", "", END, ""]`` at
    the end (as a DEALER receives them)."""
    recorded = fixture(hashes)
    replies = [[bytes.fromhex(frame) for frame in frames] for frames in recorded["replay_from_2"]]
    assert all(len(frames) == 4 for frames in replies)
    read = [replay_reply(frames) for frames in replies]
    assert all(reply is not None for reply in read)
    seqs = [int.from_bytes(reply[0], "big") for reply in read[:-1] if reply]
    assert seqs == list(range(2, 7))
    assert [reply[1].hex() for reply in read[:-1] if reply] == recorded["payloads"][2:]
    assert read[-1] == (END_SEQ, b"")
    # Before vLLM 0.26 the same replies had no topic frame.
    assert replay_reply([b"", *replies[0][2:]]) == read[0]
    assert replay_reply([b"", END_SEQ, b""]) == (END_SEQ, b"")
    for garbage in ([], [b"x"], [b"", b"short", b""], [b"nonempty", b"kv", END_SEQ, b""]):
        assert replay_reply(garbage) is None


def test_a_sliding_window_removal_keeps_the_block_its_full_attention_group_holds() -> None:
    """vLLM drops blocks that left the window from the sliding-window group while the
    full-attention group keeps them: the prefix still matches, until full attention drops it."""
    events = decoded("int")[0]
    index = PreciseIndex(1000, speculative_ttl=0)
    index.apply(KVBlockChanges("pool", "pod", "10.0.0.1:8000", 0, 0.0, events))
    keys = block_keys(list(range(3 * BLOCK)), BLOCK, root_key(None))
    assert index.match(keys) == {"pod": 3}
    assert index.block_size == BLOCK
    first: BlockStored = events[0]
    # Full attention drops the first block too: the prefix is gone from its start.
    index.apply(KVBlockChanges("pool", "pod", "10.0.0.1:8000", 1, 0.0,
                               [BlockRemoved(first.block_hashes[:1], "GPU", 0)]))
    assert index.match(keys) == {}
    assert index.stats.skipped == {} and index.stats.removed == 2


def test_a_reused_prefix_announced_again_is_counted_not_filed_twice() -> None:
    """vLLM's full report mode announces a prefix-cache hit's blocks again (parent None)."""
    events = decoded("int")[0]
    index = PreciseIndex(1000, speculative_ttl=0)
    change = KVBlockChanges("pool", "pod", "10.0.0.1:8000", 0, 0.0, events[:2])
    index.apply(change)
    held = len(index)
    first: BlockStored = events[0]
    index.apply(KVBlockChanges("pool", "pod", "10.0.0.1:8000", 1, 0.0, [first]))
    assert len(index) == held == 3
    assert index.stats.reannounced == 2 and index.stats.stored == 3
