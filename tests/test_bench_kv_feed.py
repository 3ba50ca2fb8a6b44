"""``lig bench``'s KV-event feed (pure, virtual time): what the simulated pods' events deliver to
the pickers' precise prefix index, and when."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest

from lig.cli import main
from scheduling.lig_sim_tokenizer import encode
from scheduling.token_blocks import block_keys, root_key
from scheduling_bench import fleet
from scheduling_bench.default_sweep import (
    KV_EVENT_DELAYS,
    PREFIX_SOURCE_POINTS,
    PREFIX_SOURCE_POLICIES,
    prefix_source_points,
)
from scheduling_bench.fleet import FleetConfig, simulate
from scheduling_bench.kv_feed import KVEventFeed, TokenIdPrompts
from scheduling_bench.prompts import segment_text
from scheduling_bench.results import RunMetrics
from scheduling_bench.runner import Point, parse_policy, run_point
from scheduling_bench.workloads import BASE_MODEL, WORKLOADS, BenchRequest, Workload, generate
from shared.kv_blocks import KVBlockChanges
from shared.kv_events import U64, BlockRemoved, BlockStored
from shared.schemas import Criticality, PolicyConfig
from simulator.engine import Engine, EngineConfig
from simulator.profiles import DEFAULT_PROFILE, PROFILES
from simulator.request import RequestSpec, SyntheticPrompt
from simulator.virtual_time import DELIVERY, VirtualClock


def small_engine(num_gpu_blocks: int) -> Engine:
    profile = msgspec.structs.replace(PROFILES[DEFAULT_PROFILE], num_gpu_blocks=num_gpu_blocks)
    return Engine(EngineConfig(profile=profile), VirtualClock(), random.Random(1))


def run_steps(engine: Engine, feed: KVEventFeed) -> list[KVBlockChanges]:
    """Step ``engine`` until it is idle, taking the feed's batch after every step."""
    clock = engine.clock
    assert isinstance(clock, VirtualClock)
    sent = []
    while (plan := engine.begin_step()) is not None:
        clock.advance_to(plan.end)
        engine.finish_step()
        changes = feed.take(engine.kv, clock.now())
        if changes is not None:
            sent.append(changes)
    return sent


def test_each_steps_events_become_one_batch_that_rebuilds_the_prefix_cache() -> None:
    engine = small_engine(120)  # 8 prompts of up to 30 blocks each: cached blocks get evicted
    feed = KVEventFeed("pool", "pod-3", "10.0.0.3:8000")
    KVEventFeed.attach(engine.kv)
    rng = random.Random(7)
    prefixes = [tuple(rng.randrange(100_000) for _ in range(300)) for _ in range(3)]
    for index in range(8):
        prompt = prefixes[index % 3] + tuple(rng.randrange(100_000) for _ in range(150))
        engine.submit(RequestSpec(f"r{index}", prompt, 4))
    sent = run_steps(engine, feed)
    assert [changes.source_seq for changes in sent] == list(range(len(sent)))
    assert {(c.pool, c.pod, c.address, c.dp_rank) for c in sent} == {
        ("pool", "pod-3", "10.0.0.3:8000", 0)}
    held: set[int] = set()
    removed = 0
    for changes in sent:
        for op in changes.ops:
            if isinstance(op, BlockStored):
                assert all(0 <= block <= U64 for block in op.block_hashes)  # normalised
                held.update(op.block_hashes)
            else:
                assert isinstance(op, BlockRemoved)
                assert held.issuperset(op.block_hashes)
                held.difference_update(op.block_hashes)
                removed += len(op.block_hashes)
    assert removed > 0
    assert held == {block & U64 for block in engine.kv._block_of}
    assert engine.kv.events == []  # taken, not left to grow
    assert feed.take(engine.kv, engine.clock.now()) is None


def test_stored_token_ids_give_the_prompts_block_keys() -> None:
    """What the precise index files a pod's blocks under equals what it looks a prompt up by."""
    engine = small_engine(1000)
    feed = KVEventFeed("pool", "pod-0", "10.0.0.0:8000")
    KVEventFeed.attach(engine.kv)
    prompt = tuple(range(5000, 5100))  # 6 full blocks of 16 and 4 tokens
    engine.submit(RequestSpec("a", prompt, 2))
    stored = [op for changes in run_steps(engine, feed) for op in changes.ops
              if isinstance(op, BlockStored)]
    tokens = [token for op in stored for token in op.token_ids]
    assert block_keys(tokens, 16, root_key(None)) == block_keys(prompt, 16, root_key(None))
    assert len(block_keys(tokens, 16, root_key(None))) == 6


def test_token_id_prompts_are_their_own_tokens() -> None:
    ids = TokenIdPrompts()
    assert ids.prompt_token_ids([1, 2, 3], None) == [1, 2, 3]
    assert ids.prompt_token_ids([[4, 5], [6]], None) == [4, 5]  # a batch: its first prompt
    assert ids.prompt_token_ids("text", None) is None
    assert ids.prompt_token_ids(["a", "b"], None) is None
    assert ids.prompt_token_ids([], None) is None
    assert ids.prompt_token_ids(None, [{"role": "user", "content": "hi"}]) is None


def token_id_workload(name: str, **fields: object) -> Workload:
    return msgspec.structs.replace(WORKLOADS[name], token_ids=True, chat=False, **fields)


def test_token_id_requests_send_the_ids_their_engine_computes_on() -> None:
    requests = generate(token_id_workload("shared-prefix"), 50, 4, seed=1)
    by_group: dict[tuple[int, int], set[tuple[int, ...]]] = {}
    for request in requests:
        body = msgspec.json.decode(request.body())
        spec = request.engine_spec(None)
        assert body["prompt"] == list(spec.prompt) and "messages" not in body
        segments = request.spec.prompt.segments
        # The ids are the simulator tokenizer's of the segments' text (one token per word).
        assert tuple(spec.prompt) == encode(" ".join(segment_text(*s) for s in segments))
        by_group.setdefault(segments[0], set()).add(tuple(spec.prompt[:segments[0][1]]))
    assert len(by_group) > 1 and all(len(prefixes) == 1 for prefixes in by_group.values())
    assert requests[0].engine_spec("adapter-1").adapter == "adapter-1"
    with pytest.raises(ValueError, match="token_ids needs chat false"):
        msgspec.structs.replace(WORKLOADS["chat"], token_ids=True).validate()


def test_policy_suffixes_pick_the_prefix_source() -> None:
    precise = parse_policy("default+precise+oracle")
    assert precise.prefix == "precise" and precise.oracle and precise.alias == "default"
    assert parse_policy("default+no-prefix").prefix == "none"
    assert parse_policy("default").prefix == "approximate"
    for label in ("default+precise", "default+no-prefix", "default+precise+oracle"):
        workload = token_id_workload("chat")
        assert Point(workload, **parse_policy(label).fields(), rate=1, duration=1).label == label
    with pytest.raises(ValueError, match="exclude each other"):
        parse_policy("default+precise+no-prefix")


def test_the_precise_index_needs_prompts_of_token_ids(tmp_path: Path, capsys) -> None:
    config = FleetConfig(prefix="precise")
    with pytest.raises(ValueError, match="token ids"):
        simulate(generate(WORKLOADS["chat"], 10, 1, seed=1), PolicyConfig(), config, seed=1)
    code = main(["bench", "--policies", "default+precise", "--duration", "1", "--jobs", "1",
                 "--out", str(tmp_path / "o"), "--no-plots"])
    assert code == 2 and "pass --token-ids" in capsys.readouterr().err


def test_without_a_prefix_index_the_default_policy_is_blind_to_prefixes() -> None:
    workload = token_id_workload("shared-prefix")
    runs = {label: run_point(Point(workload, **parse_policy(label).fields(), rate=100,
                                   duration=4))
            for label in ("default", "default+no-prefix")}
    assert runs["default+no-prefix"].prefix_cache_hit_rate < \
        runs["default"].prefix_cache_hit_rate - 0.1


def test_the_engines_cache_reaches_the_precise_index_after_the_event_delay() -> None:
    """One request on one pod: the index holds none of its blocks until ``kv_event_delay``
    after the step that cached them ended, then exactly the prompt's full blocks."""
    tokens = 16 * 40 + 5  # 40 full blocks
    request = BenchRequest(0.01, RequestSpec("a", SyntheticPrompt(((3, tokens),)), 3),
                           BASE_MODEL, Criticality.STANDARD, token_ids=True)
    delay = 0.045
    config = FleetConfig(pods=1, prefix="precise", kv_event_delay=delay)
    simulation = fleet._Simulation([request], PolicyConfig(), config, seed=1)
    index = fleet._router(simulation.replicas[0].gateway).precise
    held: list[tuple[float, int]] = []
    for step in range(400):  # a probe every millisecond, after that instant's deliveries
        simulation.loop.at(step / 1000, DELIVERY + 1, lambda now, _: held.append(
            (now, len(index))))
    run = simulation.run()
    (record,) = run.records
    assert record is not None and record.first_token_time is not None
    stored_at = record.first_token_time  # the end of the prefill step, which cached the blocks
    assert 0 < stored_at + delay < 0.4
    ids = request.engine_spec(None).prompt
    keys = block_keys(ids, 16, root_key(None))
    assert len(keys) == 40
    assert all(count == 0 for now, count in held if now < stored_at + delay - 1e-9)
    assert all(count == 40 for now, count in held if now >= stored_at + delay)
    assert index.match(keys, now=1e9) == {"pod-0": 40}  # real blocks, speculation expired


def test_precise_prefix_routing_beats_none_on_prefix_cache_hits() -> None:
    workload = token_id_workload("shared-prefix", prefix_groups=64, prefix_tokens=4_000)
    runs = {label: run_point(Point(workload, **parse_policy(label).fields(), rate=100,
                                   duration=5))
            for label in ("default+precise", "default+no-prefix")}
    precise, blind = runs["default+precise"], runs["default+no-prefix"]
    assert precise.kv_event_delay == 0.03
    assert precise.prefix_cache_hit_rate > blind.prefix_cache_hit_rate + 0.15
    assert precise.ttft.p90 is not None and blind.ttft.p90 is not None
    assert precise.ttft.p90 < blind.ttft.p90


def test_the_prefix_source_sweep_runs_every_source_on_the_same_token_id_requests() -> None:
    sweep = prefix_source_points()
    compared, by_delay = sweep[:-len(KV_EVENT_DELAYS)], sweep[-len(KV_EVENT_DELAYS):]
    assert len(compared) == len(PREFIX_SOURCE_POINTS) * len(PREFIX_SOURCE_POLICIES)
    assert all(p.workload.token_ids and not p.workload.chat for p in sweep)
    settings: dict[tuple[str, float, int, bool], list[str]] = {}
    for p in compared:
        settings.setdefault((p.workload.name, p.rate, p.pickers, p.shared_decisions),
                            []).append(p.label)
    assert all(labels == list(PREFIX_SOURCE_POLICIES) for labels in settings.values())
    assert ("shared-prefix", 100.0, 4, False) in settings
    assert [p.kv_event_delay for p in by_delay] == list(KV_EVENT_DELAYS)
    assert {p.label for p in by_delay} == {"default+precise"}
    fit = next(p.workload for p in compared if p.rate == 100.0)
    assert (fit.prefix_groups, fit.prefix_tokens) == (256, 4_000)


def test_lig_bench_compares_prefix_sources_from_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = main(["bench", "--workload", "shared-prefix", "--token-ids", "--policies",
                 "default+no-prefix,default+precise", "--kv-event-delay", "0.05", "--rates", "60",
                 "--duration", "2", "--jobs", "1", "--no-plots", "--out", str(out)])
    assert code == 0
    results = msgspec.json.decode((out / "results.json").read_bytes(), type=list[RunMetrics])
    assert [(r.policy, r.kv_event_delay) for r in results] == [
        ("default+no-prefix", 0.0), ("default+precise", 0.05)]
    assert results[1].prefix_cache_hit_rate > results[0].prefix_cache_hit_rate
