"""Benchmark how fast a pod change reaches the KV bucket: the Kubernetes source against the files.

    .venv/bin/python bench/bench_registry_kubernetes.py [--pods 100] [--changes 20]

Setup, on 127.0.0.1: a real nats-server with JetStream, the test API server
(tests/support/kube_apiserver.py) and two real registry processes publishing one pool of
``--pods`` ready pods into two buckets (two prefixes):

- ``lig registry --kubernetes`` reading an InferencePool and its pods from the API server;
- the baseline, measured in the same run: ``lig registry FILE`` reading the same endpoints from a
  YAML file (default ``--watch-interval`` 0.5 s, how endpoints changed before the Kubernetes
  source).

Each change makes one pod leave (unready; in the file, its endpoint removed) or come back; the
time from the change to the bucket's ``endpoints.<pool>`` showing it is measured by polling the
key every 5 ms. Reported: median and worst latency per source, and their ratio (median
Kubernetes / median files). The promise is < 1 s for the Kubernetes source.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nats
import yaml
from nats.aio.client import Client
from nats.js.errors import BucketNotFoundError, KeyNotFoundError
from nats.js.kv import KeyValue

from shared.schemas import EndpointSet, decode
from shared.subjects import Subjects
from tests.support.kube_apiserver import KubeApiServer
from tests.support.nats_server import NatsServer

LIG = str(Path(sys.executable).with_name("lig"))
POOL = "bench-pool"
X = "inference.networking.x-k8s.io/v1alpha2"


def pod(i: int, ready: bool) -> dict[str, Any]:
    return {"kind": "Pod", "metadata": {"name": f"vllm-{i}", "labels": {"app": "bench"}},
            "status": {"podIP": f"10.2.{i // 250}.{i % 250 + 1}",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def pool_yaml(pods: int, missing: int | None) -> str:
    endpoints = [{"name": f"vllm-{i}", "address": f"10.2.{i // 250}.{i % 250 + 1}",
                  "labels": {"app": "bench"}} for i in range(pods) if i != missing]
    return yaml.safe_dump({"apiVersion": X, "kind": "InferencePool", "metadata": {"name": POOL},
                           "spec": {"selector": {"app": "bench"}, "targetPortNumber": 8000,
                                    "endpoints": endpoints}})


async def endpoint_count(kv: KeyValue) -> int | None:
    try:
        entry = await kv.get(f"endpoints.{POOL}")
    except KeyNotFoundError:
        return None
    return len(decode(entry.value or b"", EndpointSet).endpoints)


async def open_bucket(nc: Client, prefix: str, deadline: float) -> KeyValue:
    while True:
        try:
            return await nc.jetstream().key_value(Subjects(prefix).registry_bucket)
        except BucketNotFoundError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def wait_count(kv: KeyValue, expected: int, within: float = 10.0) -> float:
    """Seconds until ``endpoints.<pool>`` holds ``expected`` endpoints (polled every 5 ms)."""
    start = time.monotonic()
    while await endpoint_count(kv) != expected:
        if time.monotonic() - start > within:
            raise TimeoutError(f"the bucket did not reach {expected} endpoints in {within} s")
        await asyncio.sleep(0.005)
    return time.monotonic() - start


async def latency(kv: KeyValue, change: Callable[[], object], expected: int) -> float:
    change()
    return await wait_count(kv, expected)


def start_registries(server: NatsServer, kubeconfig: str, inputs: Path
                     ) -> list[subprocess.Popen[bytes]]:
    """The Kubernetes-source registry (prefix kbench) and the file-source one (fbench)."""
    common = ["--nats-url", server.url, "--metrics-port", "0", "--resync-interval", "0",
              "--log-level", "WARNING"]
    return [subprocess.Popen([LIG, "registry", *argv, *common], stdout=subprocess.DEVNULL)
            for argv in (["--kubernetes", "--kubeconfig", kubeconfig, "--prefix", "kbench"],
                         [str(inputs), "--prefix", "fbench"])]


async def run(pods: int, changes: int) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {"kubernetes": [], "files": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        server = NatsServer(folder / "js")
        server.start()
        kube = KubeApiServer()
        await kube.start()
        processes: list[subprocess.Popen[bytes]] = []
        nc = await nats.connect(server.url)
        try:
            kube.put({"kind": "InferencePool", "metadata": {"name": POOL}, "spec": {
                "selector": {"matchLabels": {"app": "bench"}},
                "targetPorts": [{"number": 8000}],
                "endpointPickerRef": {"name": "picker", "port": {"number": 9002}}}})
            for i in range(pods):
                kube.put(pod(i, True))
            inputs = folder / "pool.yaml"
            inputs.write_text(pool_yaml(pods, None))
            kubeconfig = str(kube.write_kubeconfig(folder / "kubeconfig"))
            processes += start_registries(server, kubeconfig, inputs)
            deadline = time.monotonic() + 30
            buckets = {"kubernetes": await open_bucket(nc, "kbench", deadline),
                       "files": await open_bucket(nc, "fbench", deadline)}
            for kv in buckets.values():
                await wait_count(kv, pods, within=30)
            for n in range(changes):
                victim, leaving = n // 2 % pods, n % 2 == 0
                expected = pods - 1 if leaving else pods
                results["kubernetes"].append(await latency(
                    buckets["kubernetes"], partial(kube.put, pod(victim, not leaving)), expected))
                text = pool_yaml(pods, victim if leaving else None)
                results["files"].append(await latency(
                    buckets["files"], partial(inputs.write_text, text), expected))
        finally:
            await nc.close()
            for process in processes:
                process.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=5)
                if process.poll() is None:
                    process.kill()
            await kube.stop()
            server.stop()
    return results


def main() -> None:
    """Run the benchmark and print one line per source and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--changes", type=int, default=20)
    args = parser.parse_args()
    results = asyncio.run(asyncio.wait_for(run(args.pods, args.changes), 600))
    medians = {}
    for source, values in results.items():
        medians[source] = statistics.median(values)
        print(f"{source:>10}: pod change -> KV median {medians[source] * 1000:7.1f} ms, "
              f"worst {max(values) * 1000:7.1f} ms ({len(values)} changes, {args.pods} pods)")
    print(f"ratio kubernetes/files (median): {medians['kubernetes'] / medians['files']:.2f}")


if __name__ == "__main__":
    main()
