"""The simulated vLLM engine in virtual time: KV cache, preemption, LoRA, prefix caching, and the
same token timeline from the real-time driver."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import msgspec
import pytest

from scheduling import lig_sim_tokenizer
from simulator import tokenizer
from simulator.engine import (
    Engine,
    EngineConfig,
    RequestRejected,
    RequestSpec,
    StepResult,
    SyntheticPrompt,
    UnknownAdapterError,
)
from simulator.kv_cache import KVCache
from simulator.lora import AdapterSlots
from simulator.profiles import PROFILES, Profile, load_profile
from simulator.realtime import EngineRunner, PacedClock
from simulator.virtual_time import Arrival, VirtualClock, VirtualFleet, engine_rng

BASE = PROFILES["llama-3.1-8b-h100"]


def small(num_gpu_blocks: int = 28_000, **fields: float) -> Profile:
    """The default profile with fewer KV blocks or other changes."""
    return msgspec.structs.replace(BASE, num_gpu_blocks=num_gpu_blocks, **fields)


def spec(
    name: str, prompt: int, max_tokens: int, adapter: str | None = None, seed: int | None = None
) -> RequestSpec:
    """A request with a synthetic prompt unique to it unless ``seed`` is shared."""
    segment = (seed if seed is not None else hash(name) & 0xFFFFFFF, prompt)
    return RequestSpec(name, SyntheticPrompt((segment,)), max_tokens, adapter=adapter)


def test_kv_usage_rises_with_load_and_returns_to_zero() -> None:
    def usage_per_step(load: int) -> list[float]:
        fleet = VirtualFleet([EngineConfig(profile=small(4_000))])
        engine = fleet.engines[0]
        usage: list[float] = []
        arrivals = [Arrival(0.0, spec(f"r{i}", 600, 40)) for i in range(load)]
        run = fleet.run(arrivals, on_step=lambda _, __: usage.append(engine.kv.usage))
        assert all(r.output_tokens == 40 and r.finish_reason == "length" for r in run.requests)
        assert engine.kv.usage == 0.0
        assert engine.num_running == engine.num_waiting == 0
        return usage

    light, heavy = usage_per_step(4), usage_per_step(40)
    assert light[0] > 0 and max(heavy) > 5 * max(light)


def test_preemption_when_blocks_run_out_and_every_request_completes() -> None:
    # 100 blocks of 16 tokens; each request ends at 400 tokens (25 blocks): only 4 fit at once.
    fleet = VirtualFleet([EngineConfig(profile=small(100), record_token_times=True)])
    engine = fleet.engines[0]
    usage: list[float] = []
    arrivals = [Arrival(0.001 * i, spec(f"r{i}", 200, 200)) for i in range(12)]
    run = fleet.run(arrivals, on_step=lambda _, __: usage.append(engine.kv.usage))
    assert run.pods[0].preemptions > 0
    assert sum(r.preemptions for r in run.requests) == run.pods[0].preemptions
    for result in run.requests:
        assert result.output_tokens == 200
        assert result.token_times is not None and len(result.token_times) == 200
        assert list(result.token_times) == sorted(result.token_times)
    assert max(usage) <= 1.0
    assert engine.kv.usage == 0.0


def test_preempted_request_goes_back_to_the_front_and_recomputes() -> None:
    clock = VirtualClock()
    engine = Engine(EngineConfig(profile=small(10)), clock, random.Random(0))
    first = engine.submit(spec("first", 60, 100))  # 4 blocks now, up to 10 later
    second = engine.submit(spec("second", 60, 100))
    third = engine.submit(spec("third", 60, 100))
    while first.preemptions + second.preemptions == 0:
        plan = engine.begin_step()
        assert plan is not None
        clock.advance_to(plan.end)
        engine.finish_step()
    assert third.num_output == 0 and engine.num_waiting == 2  # third never fit
    assert second.preemptions == 1 and first.preemptions == 0  # the newest is preempted
    assert second.num_computed == 0 and second.num_output > 0
    assert second.blocks == []


def test_max_loras_is_never_exceeded_and_a_waiting_adapter_does_not_block_others() -> None:
    config = EngineConfig(adapters=("a", "b", "c", "d"), max_loras=2, max_cpu_loras=4)
    fleet = VirtualFleet([config])
    batches: list[frozenset[str]] = []

    def watch(_: int, result: StepResult) -> None:
        batches.append(result.plan.adapters)

    arrivals = [
        Arrival(0.0, spec("a1", 100, 300, "a")),
        Arrival(0.0, spec("b1", 100, 300, "b")),
        Arrival(0.01, spec("c1", 100, 20, "c")),  # must wait: a and b fill the slots
        Arrival(0.02, spec("base", 100, 20)),  # behind c1 in the queue, yet not held by it
    ]
    arrivals += [Arrival(0.03 + 0.01 * i, spec(f"x{i}", 50, 30, "abcd"[i % 4])) for i in range(24)]
    arrivals += [Arrival(10.0, spec("a2", 50, 5, "a")), Arrival(10.0, spec("b2", 50, 5, "b"))]
    run = fleet.run(arrivals, on_step=watch)
    assert batches and max(len(adapters) for adapters in batches) == 2
    for arrival, result in zip(sorted(arrivals, key=lambda a: a.time), run.requests, strict=True):
        assert result.output_tokens == arrival.spec.max_tokens
    by_id = {r.request_id: r for r in run.requests}
    base, c1 = by_id["base"], by_id["c1"]
    assert base.ttft is not None and c1.ttft is not None
    assert base.arrival_time + base.ttft < c1.arrival_time + c1.ttft
    # a and b from disk, then c and d in their place, then a and b back from the CPU cache.
    assert (run.pods[0].adapter_loads, run.pods[0].adapter_disk_loads) == (6, 4)


def test_adapter_load_time_lengthens_the_first_step() -> None:
    fleet = VirtualFleet([EngineConfig(adapters=("a",))])
    plans: list[float] = []
    fleet.run(
        [Arrival(0.0, spec("cold", 32, 2, "a")), Arrival(5.0, spec("warm", 32, 2, "a"))],
        on_step=lambda _, result: plans.append(result.plan.duration),
    )
    cold, warm = plans[0], plans[2]
    assert cold - warm == pytest.approx(BASE.lora_load_disk_s, rel=1e-6)


def test_repeated_prompt_hits_the_prefix_cache_and_gets_a_shorter_ttft() -> None:
    prompt = tuple(range(1000))
    fleet = VirtualFleet([EngineConfig()])
    run = fleet.run(
        [
            Arrival(0.0, RequestSpec("first", prompt, 10)),
            Arrival(1.0, RequestSpec("again", prompt, 10)),
        ]
    )
    first, again = run.requests
    assert first.cached_tokens == 0
    assert again.cached_tokens == 992  # full blocks, at most 999 tokens: 62 x 16
    # Only the 8 tokens after the cached blocks are computed, attending to all 1000.
    assert first.ttft == pytest.approx(BASE.step_time(1000, 0, 1000), rel=1e-9)
    assert again.ttft == pytest.approx(BASE.step_time(8, 0, 1000), rel=1e-9)
    assert again.ttft < first.ttft / 3
    counters = run.pods[0]
    assert (counters.prefix_cache_queries, counters.prefix_cache_hits) == (2000, 992)


def test_a_shared_system_prompt_is_cached_across_requests() -> None:
    def request(name: str) -> RequestSpec:
        return RequestSpec(name, SyntheticPrompt(((7, 320), (hash(name) & 0xFFFF, 200))), 5)

    run = VirtualFleet([EngineConfig()]).run([Arrival(i * 0.5, request(f"r{i}")) for i in range(3)])
    assert [r.cached_tokens for r in run.requests] == [0, 320, 320]


def test_a_multi_turn_chat_reuses_the_blocks_of_the_previous_answer() -> None:
    turn1 = [("system", "You are terse."), ("user", "Tell me about prefix caching in vLLM.")]
    prompt1 = lig_sim_tokenizer.encode(lig_sim_tokenizer.render_chat(turn1))
    words = tokenizer.generate_words(64, seed=3)
    output = tuple(tokenizer.WORD_IDS[word] for word in words)
    answer = "".join(tokenizer.token_text(word, index == 0) for index, word in enumerate(words))
    turn2 = [*turn1, ("assistant", answer), ("user", "And with LoRA?")]
    prompt2 = lig_sim_tokenizer.encode(lig_sim_tokenizer.render_chat(turn2))
    assert prompt2[: len(prompt1) + len(output)] == prompt1 + output

    run = VirtualFleet([EngineConfig()]).run(
        [
            Arrival(0.0, RequestSpec("t1", prompt1, 64, output=output)),
            Arrival(5.0, RequestSpec("t2", prompt2, 8)),
        ]
    )
    reused = run.requests[1].cached_tokens
    assert reused == (len(prompt1) + len(output) - 1) // 16 * 16
    assert reused > len(prompt1)  # blocks holding the generated answer were reused too


def test_chunked_prefill_keeps_every_step_within_the_token_budget() -> None:
    fleet = VirtualFleet([EngineConfig(max_num_batched_tokens=2048)])
    plans = []
    run = fleet.run(
        [Arrival(0.0, spec("long", 5000, 5)), Arrival(0.0, spec("short", 100, 5))],
        on_step=lambda _, result: plans.append(result.plan),
    )
    assert all(plan.prefill_tokens + plan.decode_tokens <= 2048 for plan in plans)
    # The long prompt, first in line, takes the whole budget twice; the short one then shares
    # the third step with the long prompt's last 904 tokens.
    assert [plan.prefill_tokens for plan in plans[:3]] == [2048, 2048, 904 + 100]
    long, short = run.requests
    assert long.ttft == pytest.approx(sum(plan.duration for plan in plans[:3]))
    assert short.ttft == long.ttft


def test_max_num_seqs_caps_the_running_batch() -> None:
    fleet = VirtualFleet([EngineConfig(max_num_seqs=8)])
    engine = fleet.engines[0]
    running: list[int] = []
    fleet.run(
        [Arrival(0.0, spec(f"r{i}", 50, 20)) for i in range(30)],
        on_step=lambda _, __: running.append(engine.num_running),
    )
    assert max(running) == 8


def test_same_seed_same_run_and_jitter_follows_the_seed() -> None:
    config = EngineConfig(profile=small(jitter=0.2), record_token_times=True)
    arrivals = [Arrival(0.01 * i, spec(f"r{i}", 300, 30)) for i in range(20)]

    def token_times(seed: int) -> list[tuple[float, ...] | None]:
        return [r.token_times for r in VirtualFleet([config], seed=seed).run(arrivals).requests]

    assert token_times(1) == token_times(1)
    assert token_times(1) != token_times(2)


def test_rejections() -> None:
    engine = Engine(EngineConfig(adapters=("a",)), VirtualClock(), random.Random(0))
    with pytest.raises(UnknownAdapterError, match="does not exist"):
        engine.submit(spec("x", 10, 10, "nope"))
    with pytest.raises(RequestRejected, match="maximum context length is 131072"):
        engine.submit(spec("x", 131_000, 100))
    with pytest.raises(RequestRejected, match="max_tokens"):
        engine.submit(spec("x", 10, 0))
    tiny = Engine(EngineConfig(profile=small(10)), VirtualClock(), random.Random(0))
    with pytest.raises(RequestRejected, match="KV cache"):
        tiny.submit(spec("x", 150, 20))
    assert engine.num_waiting == tiny.num_waiting == 0


def test_abort_frees_blocks_now_or_at_the_end_of_the_step() -> None:
    clock = VirtualClock()
    engine = Engine(EngineConfig(), clock, random.Random(0))
    running = engine.submit(spec("running", 100, 50))
    waiting = engine.submit(spec("waiting", 100, 50))
    plan = engine.begin_step()
    assert plan is not None and engine.num_running == 2
    engine.abort(running)  # in the step in flight: dropped when it ends
    assert engine.num_running == 2 and not running.finished
    clock.advance_to(plan.end)
    result = engine.finish_step()
    assert running.finished and running.finish_reason == "abort" and running in result.finished
    assert running not in result.emitted and engine.num_running == 1
    engine.abort(waiting)  # running, no step in flight: dropped now
    assert waiting.finished and engine.kv.usage == 0.0 and not engine.has_work
    assert engine.counters.aborted == 2 and engine.begin_step() is None


def test_snapshot_reports_adapters_and_queues() -> None:
    config = EngineConfig(adapters=("a", "b"), max_loras=1)
    engine = Engine(config, VirtualClock(), random.Random(0))
    engine.submit(spec("a1", 100, 10, "a"))
    engine.submit(spec("b1", 100, 10, "b"))
    engine.submit(spec("plain", 100, 10))
    assert engine.begin_step() is not None
    snapshot = engine.snapshot()
    assert (snapshot.running, snapshot.waiting) == (2, 1)
    assert snapshot.running_adapters == {"a"} and snapshot.waiting_adapters == {"b"}
    assert snapshot.max_lora == 1 and 0 < snapshot.kv_cache_usage < 0.01
    assert (snapshot.block_size, snapshot.num_gpu_blocks) == (16, BASE.num_gpu_blocks)


def test_profiles_load_from_files_over_a_built_in_base(tmp_path: Path) -> None:
    path = tmp_path / "a100.yaml"
    path.write_text("base: llama-3.1-8b-h100\nb0: 0.008\nnum_gpu_blocks: 9000\n")
    profile = load_profile(str(path))
    assert (profile.name, profile.b0, profile.num_gpu_blocks) == ("a100", 0.008, 9000)
    assert profile.b1 == BASE.b1
    path.write_text("b0: -1\n")
    with pytest.raises(ValueError, match="b0"):
        load_profile(str(path))
    path.write_text("no_such_field: 1\n")
    with pytest.raises(ValueError, match="no_such_field"):
        load_profile(str(path))
    with pytest.raises(ValueError, match="unknown profile"):
        load_profile("no-such-profile")


def test_kv_cache_evicts_the_least_recently_freed_block_first() -> None:
    kv = KVCache(num_blocks=4, block_size=16)
    blocks = kv.allocate(4)
    assert blocks is not None and kv.allocate(1) is None and kv.usage == 1.0
    for block, content in zip(blocks, (10, 11, 12, 13), strict=True):
        kv.cache(block, content)
    kv.release(blocks[:2])  # freed tail first: block 1, then block 0
    kv.release(blocks[2:])
    assert kv.usage == 0.0 and kv.cached_prefix([10, 11, 12]) == blocks[:3]
    kv.take(kv.cached_prefix([10]))  # reused: out of the free queue
    assert kv.num_free == 3
    fresh = kv.allocate(1)
    assert fresh == [blocks[1]] and kv.cached_prefix([10, 11]) == [blocks[0]]


def test_adapter_slots_load_from_disk_then_from_the_cpu_cache() -> None:
    slots = AdapterSlots(max_loras=1, max_cpu_loras=2, cpu_load_s=0.1, disk_load_s=0.5)
    assert slots.activate(["a"]).seconds == 0.5
    assert slots.activate(["a"]).seconds == 0.0
    assert slots.activate(["b"]).from_disk == 1
    assert slots.activate(["a"]).seconds == 0.1  # evicted from the GPU, kept on the CPU
    assert slots.activate(["c"]).from_disk == 1 and slots.in_cpu_cache == ("a", "c")
    assert slots.on_gpu == ("c",)


async def test_real_time_and_virtual_time_give_the_same_token_timeline() -> None:
    config = EngineConfig(
        profile=small(80, jitter=0.1), adapters=("a",), max_loras=1, record_token_times=True
    )
    clock = PacedClock(time_scale=40.0)
    runner = EngineRunner(Engine(config, clock, engine_rng(5, 0)), clock)
    task = asyncio.create_task(runner.run())
    submitted = []
    all_done = asyncio.Event()

    waves = ((6, 0.004), (4, 0.06), (3, 0.0))  # (requests, wall seconds before the next wave)

    def check_done() -> None:
        expected = sum(count for count, _ in waves)
        if len(submitted) == expected and all(request.finished for request in submitted):
            all_done.set()

    try:
        for wave, (count, pause) in enumerate(waves):
            for index in range(count):
                name = f"w{wave}-{index}"
                adapter = "a" if index % 3 == 0 else None
                submitted.append(runner.submit(spec(name, 120 + 40 * index, 60, adapter)))
                submitted[-1].watcher = check_done
            await asyncio.sleep(pause)  # the second wave lands mid-run, the third after idling
        async with asyncio.timeout(20):
            await all_done.wait()
    finally:
        task.cancel()
    assert runner.engine.counters.preemptions > 0  # 80 blocks: the run has to preempt
    assert any(  # some arrivals landed while the engine was busy, not only when it was idle
        other.finish_time is not None
        and other.arrival_time < request.arrival_time < other.finish_time
        for request in submitted
        for other in submitted
    )

    replay = VirtualFleet([config], seed=5).run(
        [Arrival(r.arrival_time, r.spec, pod=0) for r in submitted]
    )
    for live, virtual in zip(submitted, replay.requests, strict=True):
        assert live.token_times is not None and virtual.token_times is not None
        assert virtual.token_times == pytest.approx(live.token_times, abs=1e-9, rel=0)


def test_the_engine_module_re_exports_the_names_drivers_import() -> None:
    # Drivers and benchmarks import these from simulator.engine; since the engine's split they
    # live in modules of their own, and must be the very same objects (isinstance, pattern
    # matching and msgspec decoding across modules depend on it).
    from simulator import engine, reports, request

    homes = {
        "Request": request,
        "RequestSpec": request,
        "SyntheticPrompt": request,
        "Status": request,
        "StepPlan": reports,
        "StepResult": reports,
        "EngineCounters": reports,
        "EngineSnapshot": reports,
    }
    for name, home in homes.items():
        assert getattr(engine, name) is getattr(home, name), name
    assert set(homes) <= set(engine.__all__)
    for name in ("Engine", "EngineConfig", "Clock", "RequestRejected", "UnknownAdapterError"):
        assert name in engine.__all__ and hasattr(engine, name), name
