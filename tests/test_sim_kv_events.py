"""The simulator's KV-cache events (pure logic): they describe its prefix cache exactly; the
``--kv-events-config`` parsing; and the consumer's sequence tracking."""

from __future__ import annotations

import random

import msgspec
import pytest

from services.kvevents.sequencing import SequenceTracker, Verdict
from shared.kv_events import BlockRemoved, BlockStored, Event
from simulator.engine import EngineConfig
from simulator.kv_events import bind_address, parse_config
from simulator.profiles import PROFILES
from simulator.request import RequestSpec
from simulator.virtual_time import Arrival, VirtualFleet


def run_with_events(num_gpu_blocks: int, arrivals: list[Arrival]) -> tuple[list[Event], set[int]]:
    """The events a run recorded, and the hashes its prefix cache holds at the end."""
    profile = msgspec.structs.replace(PROFILES["llama-3.1-8b-h100"], num_gpu_blocks=num_gpu_blocks)
    fleet = VirtualFleet([EngineConfig(profile=profile)])
    kv = fleet.engines[0].kv
    kv.events = []
    fleet.run(arrivals)
    return kv.events, set(kv._block_of)


def shared_prefix_workload(count: int, seed: int = 1) -> list[Arrival]:
    """Token-id prompts over 8 shared prefixes, with known outputs (as the HTTP server sends)."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(50_000) for _ in range(rng.randrange(40, 400)))
                for _ in range(8)]
    arrivals = []
    for index in range(count):
        suffix = tuple(rng.randrange(50_000) for _ in range(rng.randrange(1, 200)))
        output = tuple(rng.randrange(50_000) for _ in range(40))
        arrivals.append(Arrival(index * 0.02, RequestSpec(
            f"r{index}", rng.choice(prefixes) + suffix, rng.randrange(1, 40), output=output)))
    return arrivals


def test_events_replayed_in_order_rebuild_the_prefix_cache_exactly() -> None:
    # 300 blocks for 200 requests of up to ~40 blocks each: plenty of eviction.
    events, cached = run_with_events(300, shared_prefix_workload(200))
    held: set[int] = set()
    removed = stored = 0
    for event in events:
        if isinstance(event, BlockStored):
            assert held.isdisjoint(event.block_hashes)  # never stored twice while cached
            assert len(event.token_ids) == 16 * len(event.block_hashes)
            held.update(event.block_hashes)
            stored += len(event.block_hashes)
        else:
            assert isinstance(event, BlockRemoved)
            assert held.issuperset(event.block_hashes)  # only what was stored leaves
            held.difference_update(event.block_hashes)
            removed += len(event.block_hashes)
    assert removed > 100 and stored > removed
    assert held == cached


def test_stored_blocks_carry_their_tokens_and_chain_to_their_parent() -> None:
    prompt = tuple(range(1000, 1100))  # 6 full blocks and 4 tokens
    events, _ = run_with_events(1000, [Arrival(0.0, RequestSpec("a", prompt, 1, output=(7,)))])
    stored = [event for event in events if isinstance(event, BlockStored)]
    hashes = [h for event in stored for h in event.block_hashes]
    assert [t for event in stored for t in event.token_ids] == list(prompt[:96])
    assert stored[0].parent_block_hash is None
    for event in stored[1:]:
        assert event.parent_block_hash == hashes[hashes.index(event.block_hashes[0]) - 1]


def test_no_events_are_recorded_unless_asked() -> None:
    fleet = VirtualFleet([EngineConfig()])
    fleet.run(shared_prefix_workload(20))
    assert fleet.engines[0].kv.events is None


def test_kv_events_config_is_vllms_json() -> None:
    config = parse_config('{"enable_kv_cache_events": true, "publisher": "zmq", '
                          '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", '
                          '"topic": "kv", "hwm": 10}')
    assert config.enabled and config.topic == "kv" and config.buffer_steps == 10_000
    assert not parse_config('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    assert bind_address("tcp://*:5557", "127.0.0.1", 3) == "tcp://127.0.0.1:5560"
    assert bind_address("tcp://10.0.0.1:5557", "127.0.0.1", 0) == "tcp://10.0.0.1:5557"
    for bad in ('{"enable_kv_cache_events": "yes"}', '{"endpoint": "ipc:///x"}',
                '{"enable_kv_cache_events": true, "publisher": "kafka"}',
                '{"buffer_steps": 0}', '{"endpoint": "tcp://*:70000"}', "not json"):
        with pytest.raises(ValueError, match="--kv-events-config"):
            parse_config(bad)


def test_sequence_tracker_verdicts() -> None:
    tracker = SequenceTracker()
    assert tracker.classify(0, 10.0) is Verdict.APPLY
    tracker.applied(0, 10.0)
    assert tracker.classify(3, 13.0) is Verdict.GAP
    # A replay from 1 brings 1..5; the PUB socket then delivers 4 and 5 again.
    tracker.replaying()
    for seq in range(1, 6):
        tracker.applied(seq, 10.0 + seq)
    assert tracker.classify(4, 14.0) is Verdict.DUPLICATE
    assert tracker.classify(5, 15.0) is Verdict.DUPLICATE
    # In the range a replay re-sent, but newer than anything applied: a restarted engine
    # (its first batches were lost while the subscriber reconnected).
    assert tracker.classify(4, 99.0) is Verdict.RESET
    assert tracker.classify(6, 16.0) is Verdict.APPLY
    tracker.applied(6, 16.0)
    # Below anything a replay re-sent: the engine restarted.
    assert tracker.classify(0, 17.0) is Verdict.RESET
    assert tracker.classify(0, 1.0) is Verdict.RESET
    tracker.restart()
    assert tracker.classify(0, 1.0) is Verdict.APPLY
    tracker.applied(0, 1.0)
    tracker.skip_to(9)
    assert tracker.classify(9, 2.0) is Verdict.APPLY
