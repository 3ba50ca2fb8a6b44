"""Benchmark KV-cache events: decoding + republishing one 64-block batch, and what recording
events costs the simulator.

    .venv/bin/python bench/bench_kv_events.py [--runs 7] [--batches 2000] [--requests 2000]

1. Per batch of one ``BlockStored`` with 64 block hashes and 1,024 token ids (block size 16), in
   both encodings: ``KVEventDecoder.decode_message`` alone, and decode + building and encoding
   the ``KVBlockChanges`` message ``lig kv-events`` publishes (what it does per batch besides
   the NATS write). Baseline in the same run: a bare ``msgspec.msgpack.decode`` of the same
   payload (the floor any Python decoder pays). Medians of ``--runs`` runs, in microseconds.
2. The simulator in virtual time, shared-prefix workload, events off (the default) and on
   (every BlockStored/BlockRemoved recorded): median wall seconds and their ratio.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from collections.abc import Callable

import msgspec

from shared.kv_blocks import KVBlockChanges, encode
from shared.kv_events import BlockStored, Encoding, KVEventDecoder, encode_payload
from simulator.engine import EngineConfig, RequestSpec
from simulator.profiles import PROFILES
from simulator.virtual_time import Arrival, VirtualFleet


def batch_frames(encoding: Encoding) -> list[bytes]:
    """``[topic, seq, payload]`` of one batch storing 64 blocks of 16 tokens."""
    rng = random.Random(0)
    event = BlockStored(tuple(rng.getrandbits(64) for _ in range(64)), rng.getrandbits(64),
                        tuple(rng.randrange(128_000) for _ in range(1024)), 16, None, "GPU")
    return [b"kv", (1).to_bytes(8, "big"), encode_payload(time.time(), [event], encoding)]


def per_call_us(call: Callable[[], object], count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        call()
    return (time.perf_counter() - start) / count * 1e6


def bench_decode(runs: int, batches: int) -> None:
    order: tuple[Encoding, ...] = ("map", "array")
    for encoding in order:
        frames = batch_frames(encoding)
        decoder = KVEventDecoder()

        def decode_only(frames: list[bytes] = frames, decoder: KVEventDecoder = decoder) -> None:
            decoder.decode_message(frames)

        def decode_and_encode(frames: list[bytes] = frames,
                              decoder: KVEventDecoder = decoder) -> None:
            batch = decoder.decode_message(frames)
            assert batch is not None
            encode(KVBlockChanges("pool", "pod", "10.0.0.1:8000", batch.seq, batch.ts,
                                  list(batch.events), batch.dp_rank or 0))

        def floor(payload: bytes = frames[2]) -> None:
            msgspec.msgpack.decode(payload)

        calls = (("msgpack floor", floor), ("decode", decode_only),
                 ("decode + republish", decode_and_encode))
        samples: dict[str, list[float]] = {name: [] for name, _ in calls}
        for _ in range(runs):  # interleaved, so load changes on the machine hit all alike
            for name, call in calls:
                samples[name].append(per_call_us(call, batches))
        results = {name: statistics.median(values) for name, values in samples.items()}
        base = results["msgpack floor"]
        print(f"{encoding:5} encoding, {len(frames[2])} bytes per batch:")
        for name, value in results.items():
            print(f"  {name:20} {value:8.1f} us per 64-block batch   x{value / base:.2f}")


def workload(count: int) -> list[Arrival]:
    rng = random.Random(1)
    prefixes = [tuple(rng.randrange(50_000) for _ in range(rng.randrange(200, 2000)))
                for _ in range(16)]
    return [Arrival(index * 0.002, RequestSpec(
        f"r{index}", rng.choice(prefixes) + tuple(rng.randrange(50_000) for _ in range(100)),
        rng.randrange(20, 200), output=tuple(rng.randrange(50_000) for _ in range(200))))
        for index in range(count)]


def simulator_seconds(arrivals: list[Arrival], events: bool) -> tuple[float, int]:
    profile = msgspec.structs.replace(PROFILES["llama-3.1-8b-h100"], num_gpu_blocks=4000)
    fleet = VirtualFleet([EngineConfig(profile=profile)])
    kv = fleet.engines[0].kv
    if events:
        kv.events = []
    start = time.perf_counter()
    fleet.run(arrivals)
    return time.perf_counter() - start, len(kv.events or ())


def bench_simulator(runs: int, requests: int) -> None:
    arrivals = workload(requests)
    off: list[float] = []
    on: list[float] = []
    recorded = 0
    for _ in range(runs):  # interleaved, so load changes on the machine hit both alike
        off.append(simulator_seconds(arrivals, False)[0])
        seconds, recorded = simulator_seconds(arrivals, True)
        on.append(seconds)
    base, with_events = statistics.median(off), statistics.median(on)
    print(f"simulator, {requests} requests on one pod with eviction ({recorded} events):")
    print(f"  events off {base:.3f} s   events on {with_events:.3f} s   "
          f"ratio x{with_events / base:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    print(f"python {platform.python_version()}, msgspec {msgspec.__version__}, "
          f"medians of {args.runs} runs")
    bench_decode(args.runs, args.batches)
    bench_simulator(args.runs, args.requests)


if __name__ == "__main__":
    main()
