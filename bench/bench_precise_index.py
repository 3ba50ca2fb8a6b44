"""Benchmark the picker's precise prefix index (scheduling/precise_index.py).

    .venv/bin/python bench/bench_precise_index.py [--runs 7] [--batches 2000] [--blocks 1000000]

1. Applying one message of ``lig kv-events``: a ``BlockStored`` of 64 blocks of 16 tokens,
   chained on the previous one, into an index at its bound (so every batch also evicts 64
   blocks). Baseline in the same run: a bare ``msgspec.msgpack.decode`` of the same message
   (what receiving it costs at the least); also decode + apply, the picker's work per message.
2. The request path for a 4,000-token prompt (250 blocks of 16) over 8 pods, one holding the
   whole prompt and the others its first 50 blocks: ``block_keys``, ``match`` and
   ``speculate``; the baseline is ``block_keys`` (hashing the tokens, which any precise lookup
   needs).
3. A whole routing decision (``Router.route``, prefix-aware policy, 8 pods) for a completion
   prompt of 4,000 token ids (a tokenizer that returns them as they are, so tokenization costs
   nothing here): precise scoring (every pod publishes events, one holds the prompt) against
   the same router without a tokenizer (the approximate index) in the same run; CPU time.
4. Memory (in a fresh process, so nothing else is counted): RSS before and after filling an
   index bounded at ``--blocks`` blocks over 8 pods, and the bytes per block.

Medians of ``--runs`` interleaved runs, in microseconds.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.flags import at_least
from scheduling.precise_index import PreciseIndex
from scheduling.token_blocks import block_keys, root_key
from services.picker.routing import Routed, Router
from services.picker.state import PodTable
from shared.kv_blocks import KVBlockChanges, decode, encode
from shared.kv_events import BlockStored
from shared.registry_view import RegistryView
from shared.schemas import Endpoint, EndpointSet, InferencePool, PodMetrics, PolicyConfig

BLOCK = 16
BATCH_BLOCKS = 64
WARM_BATCHES = 16  # applied before timing, so that the timed ones evict


def chained_batches(pod: str, count: int, rng: random.Random) -> Iterator[KVBlockChanges]:
    """``count`` messages of one pod, each storing 64 new blocks chained on the one before."""
    parent = None
    for seq in range(count):
        hashes = tuple(rng.getrandbits(64) for _ in range(BATCH_BLOCKS))
        tokens = tuple(rng.randrange(128_000) for _ in range(BATCH_BLOCKS * BLOCK))
        yield KVBlockChanges("pool", pod, "10.0.0.1:8000", seq, 0.0,
                             [BlockStored(hashes, parent, tokens, BLOCK, None, "GPU")])
        parent = hashes[-1]


def per_call_us(calls: list[Callable[[], object]]) -> float:
    start = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - start) / len(calls) * 1e6


def _decode_and_apply(index: PreciseIndex, payload: bytes) -> None:
    index.apply(decode(payload))


def bench_apply(runs: int, batches: int) -> None:
    rng = random.Random(0)
    samples: dict[str, list[float]] = {"msgpack floor": [], "apply": [], "decode + apply": []}
    for _ in range(runs):  # interleaved, so load changes on the machine hit all alike
        messages = list(chained_batches("pod-0", batches, rng))
        payloads = [encode(message) for message in messages]
        # At the bound from the start: every batch evicts as many blocks as it stores.
        index = PreciseIndex(BATCH_BLOCKS * WARM_BATCHES)
        first, rest = messages[:WARM_BATCHES], messages[WARM_BATCHES:]
        for message in first:
            index.apply(message)
        half = len(rest) // 2
        samples["msgpack floor"].append(per_call_us(
            [partial(msgspec.msgpack.decode, payload) for payload in payloads]))
        samples["apply"].append(per_call_us(
            [partial(index.apply, message) for message in rest[:half]]))
        samples["decode + apply"].append(per_call_us(
            [partial(_decode_and_apply, index, payload)
             for payload in payloads[WARM_BATCHES + half:]]))
        assert index.stats.evicted > 0 and len(index) == index.max_blocks
    results = {name: statistics.median(values) for name, values in samples.items()}
    base = results["msgpack floor"]
    print(f"apply one message: BlockStored of {BATCH_BLOCKS} blocks x {BLOCK} tokens "
          f"({len(payloads[0])} bytes), index at its bound (evicting):")
    for name, value in results.items():
        print(f"  {name:16} {value:8.1f} us per batch   x{value / base:.2f}")


def bench_request(runs: int, requests: int) -> None:
    rng = random.Random(1)
    tokens = [rng.randrange(128_000) for _ in range(4000)]
    root = root_key(None)
    keys = block_keys(tokens, BLOCK, root)
    index = PreciseIndex(1_000_000)
    for pod in range(8):
        held = len(keys) if pod == 0 else 50
        hashes = tuple(range(pod * 1000, pod * 1000 + held))
        index.apply(KVBlockChanges("pool", f"pod-{pod}", "10.0.0.1:8000", 0, 0.0, [
            BlockStored(hashes, None, tuple(tokens[:held * BLOCK]), BLOCK, None, None)]))
    assert index.match(keys) == {"pod-0": len(keys), **{f"pod-{n}": 50 for n in range(1, 8)}}
    clock = iter(range(10**9))
    samples: dict[str, list[float]] = {"block_keys": [], "match": [], "speculate": []}
    for _ in range(runs):
        samples["block_keys"].append(per_call_us(
            [lambda: block_keys(tokens, BLOCK, root)] * requests))
        samples["match"].append(per_call_us([lambda: index.match(keys)] * requests))
        # One request a second of virtual time: every call also expires one older speculation.
        samples["speculate"].append(per_call_us(
            [lambda: index.speculate(f"pod-{next(clock) % 8}", keys, next(clock))] * requests))
    results = {name: statistics.median(values) for name, values in samples.items()}
    base = results["block_keys"]
    print(f"request path, 4,000-token prompt ({len(keys)} blocks), 8 pods with events:")
    for name, value in results.items():
        print(f"  {name:16} {value:8.1f} us per request   x{value / base:.2f}")


class TokenIds:
    """The pool's tokenizer for prompts given as token ids: they are the tokens."""

    def prompt_token_ids(self, prompt: object, messages: object) -> Sequence[int] | None:
        """``prompt`` when it is a list of token ids."""
        return prompt if isinstance(prompt, list) else None


def routing_fleet(precise: bool, tokens: list[int]) -> Router:
    """A prefix-aware router over 8 idle pods; with ``precise``, every pod publishes events, one
    holds the whole prompt, the others its first 50 blocks, and the pool has a tokenizer."""
    router = Router("pool", PodTable(stale_after=3600.0), random.Random(1))
    view = RegistryView()
    view.pools["pool"] = InferencePool(name="pool", target_port=8000,
                                       policy=PolicyConfig("prefix-aware"))
    endpoints = tuple(Endpoint(f"pod-{n}", "10.0.0.1", 8000 + n) for n in range(8))
    view.endpoints["pool"] = EndpointSet(pool="pool", endpoints=endpoints)
    view.models["pool"] = {}
    router.update(view)
    for seq, endpoint in enumerate(endpoints, start=1):
        router.pods.apply(PodMetrics(pool="pool", pod=endpoint.name, address=endpoint.hostport,
                                     seq=seq, scrape_time_ns=seq, scrape_duration_s=0.0,
                                     ok=True))
    if precise:
        router.tokenizer = TokenIds()
        for n, endpoint in enumerate(endpoints):
            held = len(tokens) // BLOCK if n == 0 else 50
            router.precise.apply(KVBlockChanges(
                "pool", endpoint.name, endpoint.hostport, 0, 0.0,
                [BlockStored(tuple(range(n * 1000, n * 1000 + held)), None,
                             tuple(tokens[:held * BLOCK]), BLOCK, None, None)]))
    return router


def bench_route(runs: int, requests: int) -> None:
    rng = random.Random(4)
    tokens = [rng.randrange(128_000) for _ in range(4000)]
    body = msgspec.json.encode({"model": "m", "prompt": tokens, "max_tokens": 16})
    routers = {"approximate": routing_fleet(False, tokens), "precise": routing_fleet(True, tokens)}
    picks = {name: router.route(body) for name, router in routers.items()}
    precise_pick = picks["precise"]
    assert isinstance(precise_pick, Routed) and precise_pick.pod == "pod-0", precise_pick
    samples: dict[str, list[float]] = {name: [] for name in routers}
    for _ in range(runs):
        for name, router in routers.items():
            start = time.process_time()
            for _ in range(requests):
                router.route(body)
            samples[name].append((time.process_time() - start) / requests * 1e6)
    results = {name: statistics.median(values) for name, values in samples.items()}
    base = results["approximate"]
    print("Router.route, 4,000 token ids in the body, prefix-aware, 8 pods (CPU time):")
    for name, value in results.items():
        print(f"  {name:16} {value:8.1f} us per request   x{value / base:.2f}")


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def fill_and_report(blocks: int) -> None:
    """(Run in a fresh process.) Fill an index to ``blocks`` over 8 pods, then keep storing
    so that it evicts; print RSS before, at the bound, and bytes per block."""
    rng = random.Random(2)
    index = PreciseIndex(blocks)
    per_pod = blocks // BATCH_BLOCKS // 8 + 2
    # Made and applied one at a time, freed as they go, so that only the index stays.
    before = rss_bytes()
    for pod in range(8):
        for message in chained_batches(f"pod-{pod}", per_pod, rng):
            index.apply(message)
    at_bound = rss_bytes()
    assert len(index) == blocks, (len(index), blocks)
    print(f"memory: {len(index):,} blocks held (bound {blocks:,}, {index.stats.evicted:,} "
          f"evicted), RSS {before / 1e6:.1f} MB empty -> {at_bound / 1e6:.1f} MB at the bound, "
          f"{(at_bound - before) / blocks:.0f} bytes per block")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=at_least(1), default=7,
                        help="interleaved runs; the medians are reported (default: 7)")
    parser.add_argument("--batches", type=at_least(WARM_BATCHES + 2), default=2000,
                        help=f"KV-event messages per run of the apply benchmark: {WARM_BATCHES} "
                        "fill the index, half the rest are timed as applied, half as "
                        "decoded and applied (default: 2000)")
    parser.add_argument("--requests", type=at_least(1), default=2000,
                        help="requests per run of the request-path and routing benchmarks "
                        "(default: 2000)")
    parser.add_argument("--blocks", type=at_least(1), default=1_000_000,
                        help="block bound of the index filled for the memory figure "
                        "(default: 1000000)")
    parser.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_only:
        fill_and_report(args.blocks)
        return
    print(f"python {platform.python_version()}, msgspec {msgspec.__version__}, "
          f"medians of {args.runs} runs")
    bench_apply(args.runs, args.batches)
    bench_request(args.runs, args.requests)
    bench_route(args.runs, args.requests)
    subprocess.run([sys.executable, __file__, "--memory-only", "--blocks", str(args.blocks)],
                   check=True)


if __name__ == "__main__":
    main()
