"""The precise prefix index (scheduling/precise_index.py): pure logic, no network."""

from __future__ import annotations

import random

import pytest

from scheduling.precise_index import PreciseIndex
from scheduling.token_blocks import block_keys, root_key
from shared.kv_blocks import KVBlockChanges, decode, encode
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.test_sim_kv_events import run_with_events, shared_prefix_workload

BS = 4  # tokens per block
ROOT = root_key(None)


def tokens(count: int, start: int = 0) -> tuple[int, ...]:
    """``count`` token ids, distinct for distinct ``start``s far enough apart."""
    return tuple(range(start, start + count))


def stored(hashes: tuple[int, ...], parent: int | None, ids: tuple[int, ...],
           lora: str | None = None, medium: str | None = "GPU") -> BlockStored:
    return BlockStored(hashes, parent, ids, BS, lora, medium)


def changes(pod: str, *ops: object, rank: int = 0, resync: bool = False) -> KVBlockChanges:
    return KVBlockChanges("pool", pod, "10.0.0.1:8000", 0, 0.0, list(ops),  # type: ignore[arg-type]
                          dp_rank=rank, resync=resync)


def keys_of(ids: tuple[int, ...], lora: str | None = None) -> list[int]:
    return block_keys(ids, BS, root_key(lora))


PROMPT = tokens(5 * BS)  # five blocks
KEYS = keys_of(PROMPT)


def test_stored_blocks_match_the_prompts_keys() -> None:
    index = PreciseIndex(100)
    index.apply(changes("a", stored((11, 12, 13), None, PROMPT[:3 * BS])))
    assert index.match(KEYS) == {"a": 3}
    assert len(index) == 3
    assert index.has_events("a") and not index.has_events("b")
    assert index.block_size == BS


def test_a_child_event_is_chained_on_its_parents_key() -> None:
    index = PreciseIndex(100)
    index.apply(changes("a", stored((11, 12), None, PROMPT[:2 * BS])))
    # vLLM's hashes are the engine's own: the key comes from the parent's key and the tokens.
    index.apply(changes("a", stored((77, 78, 79), 12, PROMPT[2 * BS:])))
    assert index.match(KEYS) == {"a": 5}


def test_unknown_parent_is_counted_and_skipped() -> None:
    index = PreciseIndex(100)
    index.apply(changes("a", stored((77, 78), 999, PROMPT[2 * BS:4 * BS])))
    assert index.match(KEYS) == {}
    assert len(index) == 0
    assert index.stats.skipped["parent"] == 2


def test_blocks_without_tokens_or_of_another_medium_are_skipped() -> None:
    index = PreciseIndex(100)
    index.apply(changes("a", stored((11, 12), None, ()), stored((13,), None, PROMPT[:BS], None,
                                                               "CPU"),
                        stored((14, 15), None, (1 << 40,) * 2 * BS)))
    assert len(index) == 0
    assert index.stats.skipped == {"no_tokens": 2, "medium": 1, "token_ids": 2}
    # Fewer token ids than blocks: the blocks with ids are filed, the rest counted.
    index.apply(changes("a", stored((21, 22, 23), None, PROMPT[:2 * BS + 1])))
    assert index.match(KEYS) == {"a": 2}
    assert index.stats.skipped["token_ids"] == 3


def test_removed_blocks_end_the_leading_run() -> None:
    index = PreciseIndex(100)
    index.apply(changes("a", stored((11, 12, 13, 14, 15), None, PROMPT)))
    index.apply(changes("a", BlockRemoved((13,))))
    assert index.match(KEYS) == {"a": 2}
    assert len(index) == 4
    index.apply(changes("a", BlockRemoved((11, 999))))
    assert index.match(KEYS) == {}
    assert index.stats.removed == 2 and index.stats.removed_unknown == 1


def test_cleared_and_resynced_ranks_forget_their_blocks() -> None:
    index = PreciseIndex(100)
    index.apply(changes("a", stored((11, 12), None, PROMPT[:2 * BS])))
    index.apply(changes("a", AllBlocksCleared(), stored((31,), None, PROMPT[:BS])))
    assert index.match(KEYS) == {"a": 1}  # what follows the clear in the batch is kept
    assert len(index) == 1
    index.apply(changes("a", AllBlocksCleared(), resync=True))
    assert index.match(KEYS) == {}
    assert len(index) == 0 and index.stats.resyncs == 1 and index.stats.cleared == 2
    # The old parent is gone with the clear: a child of it cannot be placed.
    index.apply(changes("a", stored((13,), 12, PROMPT[2 * BS:3 * BS])))
    assert index.match(KEYS) == {}


def test_data_parallel_ranks_are_caches_of_their_own_and_the_pod_holds_their_union() -> None:
    index = PreciseIndex(100)
    index.apply(changes("a", stored((11, 12), None, PROMPT[:2 * BS]), rank=0))
    # Rank 1 holds the same first block under its own hash, and more.
    index.apply(changes("a", stored((51, 52, 53), None, PROMPT[:3 * BS]), rank=1))
    assert index.match(KEYS) == {"a": 3}
    # Removing rank 0's copy keeps rank 1's; the engine hashes of one rank mean nothing to the
    # other (a removal on rank 0 of rank 1's hash does nothing).
    index.apply(changes("a", BlockRemoved((11, 12, 53)), rank=0))
    assert index.match(KEYS) == {"a": 3}
    index.apply(changes("a", AllBlocksCleared(), rank=1))
    assert index.match(KEYS) == {}
    assert len(index) == 0


def test_lora_blocks_live_under_the_adapters_root() -> None:
    index = PreciseIndex(100)
    index.apply(changes("a", stored((11, 12), None, PROMPT[:2 * BS], lora="sql")))
    assert index.match(KEYS) == {}
    assert index.match(keys_of(PROMPT, "sql")) == {"a": 2}
    assert index.lora_names == {"sql"}


def test_match_takes_each_pods_leading_run() -> None:
    index = PreciseIndex(100)
    index.apply(changes("a", stored((11, 12, 13, 14, 15), None, PROMPT)))
    index.apply(changes("b", stored((21, 22), None, PROMPT[:2 * BS])))
    other = tokens(2 * BS, 1000)
    index.apply(changes("c", stored((31, 32), None, other)))
    assert index.match(KEYS) == {"a": 5, "b": 2}
    assert index.match(KEYS[:3]) == {"a": 3, "b": 2}
    assert index.match([]) == {}
    # A pod with a later block but not the first holds no leading run.
    index.apply(changes("d", stored((41, 42), None, PROMPT[:2 * BS]), BlockRemoved((41,))))
    assert "d" not in index.match(KEYS)


def test_the_bound_evicts_the_oldest_blocks_of_the_largest_rank() -> None:
    index = PreciseIndex(6)
    index.apply(changes("a", stored((11, 12, 13, 14, 15), None, PROMPT)))
    index.apply(changes("b", stored((21, 22), None, PROMPT[:2 * BS])))
    assert len(index) == 6 and index.stats.evicted == 1
    # a lost its oldest block, hence its whole leading run; b kept both.
    assert index.match(KEYS) == {"b": 2}
    index.apply(changes("b", stored((23,), 22, PROMPT[2 * BS:3 * BS])))
    assert len(index) == 6
    assert index.match(KEYS) == {"b": 3}
    assert index.stats.evicted == 2


def test_the_bound_holds_under_churn_and_the_order_stays_small() -> None:
    rng = random.Random(3)
    index = PreciseIndex(500)
    live: dict[str, list[int]] = {"a": [], "b": []}
    for step in range(400):
        pod = rng.choice(["a", "b"])
        hashes = tuple(rng.getrandbits(64) for _ in range(rng.randrange(1, 20)))
        index.apply(changes(pod, stored(hashes, None, tokens(len(hashes) * BS, step * 100))))
        live[pod] += hashes
        if rng.random() < 0.5:
            gone = tuple(rng.sample(live[pod], min(len(live[pod]), rng.randrange(1, 15))))
            index.apply(changes(pod, BlockRemoved(gone)))
            live[pod] = [h for h in live[pod] if h not in gone]
        assert len(index) <= 500
        for entry in index._pods.values():
            for rank in (cache for groups in entry.ranks.values() for cache in groups.values()):
                assert len(rank.order) - rank.head <= 2 * len(rank.blocks) + 64 + 20
    assert index.stats.evicted > 0
    assert len(index) == sum(len(rank.blocks) for entry in index._pods.values()
                             for groups in entry.ranks.values() for rank in groups.values())


def test_max_blocks_zero_keeps_nothing() -> None:
    index = PreciseIndex(0)
    index.apply(changes("a", stored((11, 12), None, PROMPT[:2 * BS])))
    assert len(index) == 0 and index.match(KEYS) == {}
    assert index.has_events("a")


def test_speculation_counts_until_it_expires() -> None:
    index = PreciseIndex(100, speculative_ttl=2.0)
    index.apply(changes("a", stored((11,), None, PROMPT[:BS])))
    index.speculate("b", KEYS[:4], now=100.0)
    assert index.match(KEYS, now=100.5) == {"a": 1, "b": 4}
    assert index.match(KEYS, now=101.9) == {"a": 1, "b": 4}  # within the ttl
    assert index.match(KEYS, now=103.1) == {"a": 1}  # beyond 1.5 x the ttl
    index.speculate("b", [], now=103.1)  # a later speculation drops the expired ones
    assert index.speculative_blocks == 0


def test_speculation_and_real_blocks_make_one_leading_run() -> None:
    index = PreciseIndex(100, speculative_ttl=2.0)
    index.apply(changes("a", stored((11, 12), None, PROMPT[:2 * BS])))
    index.speculate("a", KEYS, now=10.0)
    index.apply(changes("a", BlockRemoved((12,))))  # its events say otherwise meanwhile
    assert index.match(KEYS, now=10.1) == {"a": 5}
    assert index.match(KEYS, now=20.0) == {"a": 1}
    # Speculation renewed counts from its newest time.
    index.speculate("a", KEYS[:3], now=20.0)
    index.speculate("a", KEYS[:3], now=21.9)
    assert index.match(KEYS, now=23.1) == {"a": 3}


def test_speculation_is_bounded() -> None:
    index = PreciseIndex(100, speculative_ttl=60.0, max_speculative=8)
    index.speculate("a", KEYS, now=0.0)
    index.speculate("b", keys_of(tokens(5 * BS, 500)), now=40.0)
    assert index.speculative_blocks <= 8
    assert index.match(KEYS, now=41.0) == {}  # a's older speculation went first
    no_ttl = PreciseIndex(100, speculative_ttl=0)
    no_ttl.speculate("a", KEYS, now=0.0)
    assert no_ttl.match(KEYS, now=0.0) == {}


def test_forget_drops_a_pod() -> None:
    index = PreciseIndex(100)
    index.apply(changes("a", stored((11, 12), None, PROMPT[:2 * BS])))
    index.apply(changes("b", stored((21,), None, PROMPT[:BS])))
    index.speculate("a", KEYS, now=0.0)
    index.forget("a")
    index.forget("nobody")
    assert index.match(KEYS, now=0.0) == {"b": 1}
    assert len(index) == 1 and index.speculative_blocks == 0
    assert not index.has_events("a") and index.event_pods() == {"b"}


def test_a_block_announced_twice_is_held_once() -> None:
    index = PreciseIndex(100)
    index.apply(changes("a", stored((11, 12), None, PROMPT[:2 * BS])))
    index.apply(changes("a", stored((11, 12), None, PROMPT[:2 * BS])))
    assert len(index) == 2
    index.apply(changes("a", BlockRemoved((12,))))
    assert index.match(KEYS) == {"a": 1}


def test_messages_round_trip_through_the_wire_encoding() -> None:
    index = PreciseIndex(100)
    message = changes("a", stored((2**64 - 1, 12), None, PROMPT[:2 * BS]))
    index.apply(decode(encode(message)))
    index.apply(decode(encode(changes("a", BlockRemoved((2**64 - 1,))))))
    assert index.match(KEYS) == {}
    assert len(index) == 1


@pytest.mark.parametrize("bad", [-1])
def test_negative_bounds_are_refused(bad: int) -> None:
    with pytest.raises(ValueError):
        PreciseIndex(bad)
    with pytest.raises(ValueError):
        PreciseIndex(10, speculative_ttl=bad)


def test_the_simulators_event_stream_rebuilds_its_cache_with_eviction() -> None:
    """The events of a simulated engine that evicts a lot, applied in order: the index holds
    exactly as many blocks as the engine caches at the end, nothing skipped or unknown, and the
    last prompt's blocks are found under the keys a tokenized prompt would give."""
    arrivals = shared_prefix_workload(200)
    events, cached = run_with_events(300, arrivals)
    index = PreciseIndex(100_000)
    for seq, event in enumerate(events):
        index.apply(KVBlockChanges("pool", "pod", "10.0.0.1:8000", seq, 0.0, [event]))
    assert index.stats.removed > 100
    assert len(index) == len(cached)
    assert not index.stats.skipped and index.stats.removed_unknown == 0
    last = arrivals[-1].spec.prompt
    assert isinstance(last, tuple)
    keys = block_keys(last, 16, root_key(None))
    assert index.match(keys) == {"pod": len(keys)}


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def numbered(pod: str, stream_seq: int, *ops: object, resync: bool = False,
             source_seq: int = 0) -> KVBlockChanges:
    return KVBlockChanges("pool", pod, "10.0.0.1:8000", source_seq, 0.0,
                          list(ops), resync=resync, stream_seq=stream_seq)  # type: ignore[arg-type]


def test_a_lost_message_makes_the_pod_incomplete_for_the_recovery_time() -> None:
    clock = Clock()
    index = PreciseIndex(100, clock=clock, recovery_s=60.0)
    index.apply(numbered("a", 0, stored((11,), None, PROMPT[:BS])))
    index.apply(numbered("a", 1, stored((12,), 11, PROMPT[BS:2 * BS])))
    assert index.incomplete_pods() == set() and index.stats.gaps == 0
    index.apply(numbered("a", 3, stored((13,), 12, PROMPT[2 * BS:3 * BS])))  # 2 was lost
    assert index.incomplete_pods() == {"a"} and index.stats.gaps == 1
    clock.now += 59.0
    index.apply(numbered("a", 4, BlockRemoved((13,))))
    assert index.incomplete_pods() == {"a"}  # in order again: the window still runs
    clock.now += 1.0
    assert index.incomplete_pods() == set()
    # Messages of an older bridge carry no numbers: nothing to judge.
    index.apply(changes("b", stored((21,), None, PROMPT[:BS])))
    assert index.incomplete_pods() == set()


def test_a_history_that_starts_late_and_a_resync_make_it_incomplete_a_restart_ends_it() -> None:
    clock = Clock()
    index = PreciseIndex(100, clock=clock)
    index.apply(numbered("a", 7, stored((11,), None, PROMPT[:BS])))  # the first 7 are unknown
    assert index.incomplete_pods() == {"a"}
    index.apply(numbered("b", 0, stored((21,), None, PROMPT[:BS])))
    index.apply(numbered("b", 1, AllBlocksCleared(), resync=True, source_seq=-1))
    assert index.incomplete_pods() == {"a", "b"} and index.stats.resyncs == 1
    # The bridge's restart marker: the engine's cache is empty, hence fully known.
    index.apply(numbered("b", 2, AllBlocksCleared(), source_seq=-1))
    assert index.incomplete_pods() == {"a"}


def test_after_a_resync_blocks_built_on_a_prefix_from_before_it_are_recovered() -> None:
    """vLLM's hashes name content: a block stored after the resync on top of a block stored
    before it is filed, not skipped for an unknown parent."""
    index = PreciseIndex(100)
    index.apply(changes("a", stored((11, 12), None, PROMPT[:2 * BS])))
    index.apply(changes("a", AllBlocksCleared(), resync=True))
    assert index.match(KEYS) == {}
    index.apply(changes("a", stored((13, 14), 12, PROMPT[2 * BS:4 * BS])))
    assert index.stats.recovered == 2 and not index.stats.skipped
    # Filed under the right keys: the chain's blocks 3 and 4 (the pod holds no leading run yet).
    assert index.match(KEYS) == {}
    index.apply(changes("a", stored((11, 12), None, PROMPT[:2 * BS])))  # the prefix again
    assert index.match(KEYS) == {"a": 4}
    assert len(index) == 4


def test_blocks_stored_on_a_parent_the_index_misses_keep_the_pod_incomplete() -> None:
    """Wholeness is observed: after a resync, every block stored on a prefix the index lost
    (recovered from the former map, or skipped for an unknown parent) renews the incomplete
    mark; the mark ends only after a recovery window with no such block."""
    clock = Clock()
    index = PreciseIndex(100, clock=clock, recovery_s=60.0)
    index.apply(numbered("a", 0, stored((11, 12), None, PROMPT[:2 * BS])))
    index.apply(numbered("a", 1, AllBlocksCleared(), resync=True, source_seq=-1))
    clock.now += 50.0
    index.apply(numbered("a", 2, stored((13,), 12, PROMPT[2 * BS:3 * BS])))  # recovered
    clock.now += 50.0
    assert index.incomplete_pods() == {"a"}  # 100 s after the resync, 50 after the evidence
    index.apply(numbered("a", 3, stored((99,), 98, PROMPT[:BS])))  # a parent never seen
    assert index.stats.skipped["parent"] == 1
    clock.now += 59.0
    assert index.incomplete_pods() == {"a"}
    # The prefix announced again (a full-report hit, or recomputed): whole once the window
    # passes with nothing missing.
    index.apply(numbered("a", 4, stored((11, 12), None, PROMPT[:2 * BS])))
    index.apply(numbered("a", 5, stored((14,), 13, PROMPT[3 * BS:4 * BS])))
    clock.now += 1.0
    assert index.incomplete_pods() == set()
    assert index.match(KEYS) == {"a": 4}


def test_the_former_maps_stay_within_the_bound() -> None:
    index = PreciseIndex(6)
    for pod in "abc":
        index.apply(changes(pod, stored((1, 2, 3, 4), None, PROMPT[:4 * BS])))
        index.apply(changes(pod, AllBlocksCleared(), resync=True))
    assert sum(len(former) for entry in index._pods.values()
               for former in entry.former.values()) <= 6
    index.forget("c")
    assert index._former == sum(len(former) for entry in index._pods.values()
                                for former in entry.former.values())


def test_a_numbering_that_starts_over_is_no_gap() -> None:
    """A bridge with no recording to continue from numbers from 0 again (and replays the pod
    from its start, or sends a resync marker, which is judged on its own)."""
    index = PreciseIndex(100, clock=Clock())
    for number in range(3):
        index.apply(numbered("a", number, stored((11 + number,), None, PROMPT[:BS])))
    index.apply(numbered("a", 0, stored((11,), None, PROMPT[:BS])))
    index.apply(numbered("a", 1, stored((12,), None, PROMPT[:BS])))
    assert index.incomplete_pods() == set() and index.stats.gaps == 0
