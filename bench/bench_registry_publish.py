"""Benchmark the registry at many models: loading the YAML, and publishing it into JetStream KV.

    .venv/bin/python bench/bench_registry_publish.py [--models 10000] [--repeats 3]

Setup, on 127.0.0.1: a real nats-server with JetStream. The input is one pool and ``--models``
InferenceModels in one YAML file, as a large fleet would have. Reported, medians over
``--repeats`` runs:

- load: parse and validate the file (``services.registry.files.load``), wall and CPU, with each
  YAML event parser the registry can use (libyaml, the default when PyYAML has it; PyYAML's own
  Python parser, the baseline);
- publish passes (``services.registry.publisher.Publisher``), wall and this process's CPU: the
  first pass into an empty bucket (every key put), an unchanged pass (what every resync does:
  read every key, write nothing) and a pass after one model changed.

Baseline, measured in the same run: the same passes with one request in flight at a time
(``concurrency=1``, how the registry published before), against the default
(``publisher.CONCURRENCY``). A pass must stay linear in the number of keys: run with
``--models 2500`` and ``--models 10000`` to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nats
import yaml
from nats.js.errors import NotFoundError

from services.registry import files
from services.registry.files import FileSnapshot, SourceFile, load
from services.registry.loader import Registry
from services.registry.publisher import CONCURRENCY, Publisher
from tests.support.nats_server import NatsServer

BUCKET = "bench-registry"
API = "inference.networking.x-k8s.io/v1alpha2"


def fleet_yaml(models: int, criticality: str = "Standard") -> str:
    """One pool with four endpoints and ``models`` models in it, as multi-document YAML."""
    documents = [{"apiVersion": API, "kind": "InferencePool", "metadata": {"name": "fleet"},
                  "spec": {"selector": {"app": "fleet"}, "targetPortNumber": 8000,
                           "endpoints": [{"name": f"pod-{i}", "address": f"10.0.0.{i + 1}"}
                                         for i in range(4)]}}]
    documents += [{"apiVersion": API, "kind": "InferenceModel", "metadata": {"name": f"m-{i}"},
                   "spec": {"modelName": f"model-{i}", "poolRef": {"name": "fleet"},
                            "criticality": criticality if i == 0 else "Standard",
                            "targetModels": [{"name": f"model-{i}-a", "weight": 90},
                                             {"name": f"model-{i}-b", "weight": 10}]}}
                  for i in range(models)]
    return yaml.safe_dump_all(documents, sort_keys=False)


async def timed(action: Callable[[], Awaitable[object]]) -> tuple[float, float]:
    """Wall and CPU seconds of one awaited action."""
    wall, cpu = time.perf_counter(), time.process_time()
    await action()
    return time.perf_counter() - wall, time.process_time() - cpu


async def passes(url: str, registry: Registry, edited: Registry, concurrency: int,
                 repeats: int) -> dict[str, list[tuple[float, float]]]:
    """Time the three kinds of pass ``repeats`` times, each first pass into a new bucket."""
    results: dict[str, list[tuple[float, float]]] = {"first": [], "unchanged": [],
                                                     "one changed": []}
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        publisher = Publisher(js, BUCKET, concurrency=concurrency)
        for _ in range(repeats):
            with contextlib.suppress(NotFoundError):
                await js.delete_key_value(BUCKET)
            results["first"].append(await timed(lambda: publisher.publish(registry)))
            results["unchanged"].append(await timed(lambda: publisher.publish(registry)))
            results["one changed"].append(await timed(lambda: publisher.publish(edited)))
            await publisher.publish(registry)  # back, for the next round
    finally:
        await nc.close()
    return results


def median(samples: list[tuple[float, float]]) -> tuple[float, float]:
    return (statistics.median(w for w, _ in samples), statistics.median(c for _, c in samples))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    text = fleet_yaml(args.models)
    print(f"{args.models:,} models, {len(text) / 1e6:.1f} MB of YAML; medians of {args.repeats}")
    default = files._loader
    cpu_by_parser = {}
    for name, loader in files.LOADERS.items():
        files._loader = loader
        loads = []
        for _ in range(args.repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            registry = load(FileSnapshot((SourceFile("fleet.yaml", text),)))
            loads.append((time.perf_counter() - wall, time.process_time() - cpu))
        wall, cpu_by_parser[name] = median(loads)
        print(f"load ({name} parser): {wall:.2f} s wall, {cpu_by_parser[name]:.2f} s CPU "
              f"({1e6 * cpu_by_parser[name] / args.models:.0f} µs CPU per model)")
    files._loader = default
    if "libyaml" in cpu_by_parser:
        print(f"load CPU ratio python/libyaml: "
              f"{cpu_by_parser['python'] / cpu_by_parser['libyaml']:.1f}x")
    edited = load(FileSnapshot((SourceFile("fleet.yaml", fleet_yaml(args.models, "Critical")),)))

    with tempfile.TemporaryDirectory() as store:
        server = NatsServer(Path(store))
        server.start()
        try:
            baseline = await passes(server.url, registry, edited, 1, args.repeats)
            ours = await passes(server.url, registry, edited, CONCURRENCY, args.repeats)
        finally:
            server.stop()
    print(f"{'pass':<12} {'1 in flight (baseline)':>26} {f'{CONCURRENCY} in flight':>26} "
          f"{'wall ratio':>10}")
    for kind in baseline:
        (base_wall, base_cpu), (wall, cpu) = median(baseline[kind]), median(ours[kind])
        print(f"{kind:<12} {base_wall:>9.2f} s wall {base_cpu:>5.2f} s CPU "
              f"{wall:>9.2f} s wall {cpu:>5.2f} s CPU {base_wall / wall:>9.1f}x")


if __name__ == "__main__":
    asyncio.run(main())
