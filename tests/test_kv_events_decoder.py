"""The KV-event decoder (pure logic): both vLLM encodings, hashes, bounds, and fuzzing."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.kv_events import (
    U64,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventDecoder,
    Limits,
    encode_payload,
    normalise_hash,
)

pack = msgspec.msgpack.encode


def message(seq: int, payload: bytes, topic: bytes = b"kv") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), payload]


STORED = BlockStored((1, 2), None, tuple(range(32)), 16, None, "GPU")
REMOVED = BlockRemoved((1,), "GPU")


def test_both_encodings_decode_to_the_same_events() -> None:
    events = [STORED, REMOVED, AllBlocksCleared()]
    for encoding in ("array", "map"):
        decoder = KVEventDecoder()
        batch = decoder.decode_message(message(7, encode_payload(1.5, events, encoding, 3)))
        assert batch is not None, decoder.skipped
        assert (batch.seq, batch.ts, batch.dp_rank, batch.events) == (7, 1.5, 3, events)
        assert not decoder.skipped


def test_vllm_shapes_with_missing_and_extra_fields() -> None:
    """What vLLM versions actually sent: a 0.8-era positional BlockStored (no medium, no rank),
    and a map with fields this decoder does not know."""
    old = pack([2.0, [["BlockStored", [10, 11], 9, list(range(8)), 4, None],
                      ["BlockRemoved", [10]], ["AllBlocksCleared"]]])
    new = pack([3.0, [{"type": "BlockStored", "block_hashes": [10], "parent_block_hash": None,
                       "token_ids": [1, 2], "block_size": 16, "lora_id": None,
                       "medium": "GPU", "lora_name": "ad", "extra_keys": [None],
                       "group_idx": 0, "kv_cache_spec_kind": "full_attention",
                       "something_new": {"x": 1}}], 0])
    decoder = KVEventDecoder()
    first = decoder.decode_payload(0, old)
    second = decoder.decode_payload(1, new)
    assert first is not None and second is not None
    assert first.dp_rank is None and first.events == [
        BlockStored((10, 11), 9, tuple(range(8)), 4), BlockRemoved((10,)), AllBlocksCleared()]
    assert second.dp_rank == 0
    assert second.events == [BlockStored((10,), None, (1, 2), 16, "ad", "GPU", 0, "full_attention")]


def test_hashes_as_uint64_int64_and_bytes_are_normalised() -> None:
    assert normalise_hash(-1) == U64 == normalise_hash(b"\xff" * 8) == normalise_hash(U64)
    assert normalise_hash(5) == normalise_hash(b"\x05") == 5
    long = bytes(range(32))
    assert normalise_hash(long) == normalise_hash(bytearray(long)) != normalise_hash(long[:8])
    assert 0 <= normalise_hash(long) <= U64  # type: ignore[operator]
    for bad in (True, 1.5, "1", None, b"", 1 << 64, -(1 << 63) - 1):
        assert normalise_hash(bad) is None
    # A removal sent as bytes finds the block stored as a signed int.
    decoder = KVEventDecoder()
    batch = decoder.decode_payload(0, pack([0.0, [
        ["BlockStored", [-2], None, [], 16, None, "GPU"],
        {"type": "BlockRemoved", "block_hashes": [(U64 - 1).to_bytes(8, "big")]}]]))
    assert batch is not None
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.block_hashes == removed.block_hashes == (U64 - 1,)


def test_malformed_messages_and_events_are_counted_and_skipped() -> None:
    decoder = KVEventDecoder(Limits(max_message_bytes=1000, max_events=3, max_hashes=4,
                                    max_block_size=16))
    good = {"type": "BlockRemoved", "block_hashes": [1]}
    cases: list[tuple[list[bytes], str]] = [
        ([b"kv", b"\x00" * 8], "frames"),
        ([b"kv", b"\x00" * 7, pack([0.0, []])], "seq"),
        (message(0, b"\xc1"), "msgpack"),
        (message(0, b"x" * 1001), "size"),
        (message(0, pack({"ts": 0})), "batch"),
        (message(0, pack([0.0, [good] * 4])), "events"),
        (message(0, pack(["now", []])), "batch"),
        (message(0, pack([0.0, [], -1])), "batch"),
    ]
    for frames, reason in cases:
        before = decoder.skipped[reason]
        assert decoder.decode_message(frames) is None
        assert decoder.skipped[reason] == before + 1, (reason, decoder.skipped)
    # Bad events inside a good batch: the others still decode.
    bad_events: list[tuple[Any, str]] = [
        ({"type": "Nope"}, "type"),
        (["BlockStored", [1], None, [], 17, None], "block_size"),
        (["BlockStored", [1] * 5, None, [], 16, None], "hash"),
        (["BlockStored", [1], None, list(range(17)), 16, None], "token_ids"),
        (["BlockStored", [1], None, [-1], 16, None], "token_ids"),
        (["BlockStored", [1], "p", [], 16, None], "hash"),
        ({"type": "BlockRemoved", "block_hashes": [1.5]}, "hash"),
        ({"type": "BlockRemoved"}, "hash"),
        (42, "event"),
    ]
    for event, reason in bad_events:
        before = decoder.skipped[reason]
        batch = decoder.decode_payload(5, pack([0.0, [event, good]]))
        assert batch is not None and batch.skipped_events == 1
        assert batch.events == [BlockRemoved((1,))]
        assert decoder.skipped[reason] == before + 1, (event, decoder.skipped)


def test_the_skip_hook_sees_every_reason() -> None:
    seen: list[str] = []
    decoder = KVEventDecoder(on_skip=seen.append)
    decoder.decode_message([b"x"])
    decoder.decode_payload(0, pack([0.0, [{"type": "Nope"}]]))
    assert seen == ["frames", "type"]


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
    | st.text(max_size=12) | st.binary(max_size=40)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    lambda children: st.lists(children, max_size=6)
    | st.dictionaries(st.sampled_from(["type", "block_hashes", "parent_block_hash", "token_ids",
                                       "block_size", "medium", "lora_name", "x"]) | st.text(
                                           max_size=5), children, max_size=6),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=300), max_size=5))
def test_fuzz_raw_frames_never_raise(frames: list[bytes]) -> None:
    decoder = KVEventDecoder()
    batch = decoder.decode_message(frames)
    assert batch is not None or sum(decoder.skipped.values()) == 1


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ts=st.floats(allow_nan=False) | st.integers(0, 1 << 40),
       events=st.lists(msgpack_values, max_size=6),
       rank=st.none() | msgpack_values)
def test_fuzz_structured_payloads_never_raise(ts: float, events: list[Any], rank: Any) -> None:
    decoder = KVEventDecoder()
    body = [ts, events] if rank is None else [ts, events, rank]
    batch = decoder.decode_payload(0, pack(body))
    if batch is not None:
        assert len(batch.events) + batch.skipped_events == len(events)
        for event in batch.events:
            for value in getattr(event, "block_hashes", ()):
                assert 0 <= value <= U64


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(-(1 << 63), U64), min_size=1, max_size=5),
                          st.integers(1, 64)), max_size=5),
       st.sampled_from(["array", "map"]))
def test_fuzz_round_trip(blocks: list[tuple[list[int], int]], encoding: Any) -> None:
    events = [BlockStored(tuple(hashes), None, (), size, None, "GPU") for hashes, size in blocks]
    batch = KVEventDecoder().decode_payload(1, encode_payload(0.0, list(events), encoding))
    assert batch is not None
    assert [event.block_hashes for event in batch.events] == [
        tuple(h & U64 for h in hashes) for hashes, _ in blocks]


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ts=st.floats(allow_nan=False) | st.integers(0, 1 << 40),
       events=st.lists(msgpack_values | st.builds(
           lambda kind, hashes, tokens, size, extra: (
               [kind, hashes, None, tokens, size, None, "GPU", *extra] if extra is not None
               else {"type": kind, "block_hashes": hashes, "token_ids": tokens,
                     "block_size": size}),
           st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]),
           st.lists(st.integers(-(1 << 63), U64) | st.binary(max_size=12), max_size=3),
           st.lists(st.integers(-2, U64), max_size=40),
           st.integers(-1, 5000),
           st.none() | st.lists(msgpack_values, max_size=3)), max_size=4),
       rank=st.none() | st.integers(-2, 1 << 17))
def test_fast_path_agrees_with_the_tolerant_path(ts: float, events: list[Any],
                                                 rank: Any) -> None:
    """Whatever the typed (fast) decoding accepts, the field-by-field decoding turns into the
    same batch: the fast path changes the cost, never the result."""
    payload = pack([ts, events] if rank is None else [ts, events, rank])
    decoder = KVEventDecoder(Limits(max_hashes=2, max_block_size=4096))
    fast = decoder._decode_typed(3, payload)
    tolerant = decoder._decode_tolerant(3, payload)
    if fast is not None:
        assert tolerant == fast


def test_a_map_encoded_batch_and_bad_groups() -> None:
    """A batch sent as a map (a publisher without ``array_like``) decodes like the array; a
    ``group_idx`` that is no group number skips its event, counted."""
    event = {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 2}
    decoder = KVEventDecoder()
    batch = decoder.decode_payload(0, pack({"ts": 1.0, "events": [event],
                                            "data_parallel_rank": 3}))
    assert batch is not None and batch.events == [BlockRemoved((7,), "GPU", 2)]
    assert batch.dp_rank == 3
    for bad in (-1, 1 << 20, "1", 1.5):
        batch = decoder.decode_payload(1, pack([1.0, [{**event, "group_idx": bad}, event]]))
        assert batch is not None and batch.events == [BlockRemoved((7,), "GPU", 2)]
    assert decoder.skipped["group_idx"] == 4
