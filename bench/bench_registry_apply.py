"""A registry burst reaching a picker: N models put into the KV bucket of a real nats-server.

Measures, per round, the wall time from the first put until the picker's router resolves the
last model, the CPU time spent updating the router, and the longest loop stall: the most CPU
time the event loop's thread spent before coming back to a task waiting 2 ms (a request waiting
on the picker waits that long at least; Envoy fails an ext_proc message open after 2 s). Two
consumers of the same burst:

- ``incremental``: the picker's own wiring (``services/picker/app.py``'s NATS link: the
  registry watch coalesces a burst and hands the router only the names that changed);
- ``rebuild per entry`` (baseline, the picker before issue 13 item 6): every KV entry applied to
  the view and followed by a full ``Router.update`` (every model route rebuilt).

Medians over ``--rounds``, and their ratio. The baseline is quadratic: at ``--models 10000`` a
single round takes minutes (``--baseline-rounds 1``).

Run: ``.venv/bin/python bench/bench_registry_apply.py [--models 2000] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry

from services.picker.app import _NatsLink
from services.picker.observability import PickerMetrics
from services.picker.pools import Gateway
from services.picker.routing import Routed, Router
from services.picker.state import PodTable
from shared.nats_connection import NatsSettings, connect
from shared.registry_view import RegistryView
from shared.schemas import (
    Endpoint,
    EndpointSet,
    InferencePool,
    encode,
)
from shared.subjects import Subjects, endpoints_key, pool_key
from tests.support.nats_server import NatsServer
from tests.support.ports import free_port
from tests.support.registry_burst import LoopStall, TimedRouter, publish_models

POOL = "pool-a"
APPLY_TIMEOUT = 900.0  # seconds a round may take (the baseline at 10,000 models needs minutes)


class Round(msgspec.Struct, frozen=True):
    """One burst: seconds until applied, router-update CPU seconds, longest loop stall (CPU
    seconds), router updates."""

    wall: float
    cpu: float
    stall: float
    updates: int


Consumer = Callable[[str, Subjects, RegistryView, Router, asyncio.Event],
                    Coroutine[Any, Any, None]]


async def incremental(url: str, subjects: Subjects, view: RegistryView, router: Router,
                      stop: asyncio.Event) -> None:
    """The picker's NATS link, exactly as ``lig picker`` runs it."""
    link = _NatsLink(NatsSettings(url=url), subjects, view, Gateway.serving(router),
                     PickerMetrics(CollectorRegistry()))
    await link.run(stop)


async def rebuild_per_entry(url: str, subjects: Subjects, view: RegistryView, router: Router,
                            stop: asyncio.Event) -> None:
    """The baseline: a full router rebuild after every KV entry."""
    client = await connect(NatsSettings(url=url), "bench-baseline")
    try:
        kv = await client.jetstream().key_value(subjects.registry_bucket)
        watcher = await kv.watchall()
        async for entry in watcher:
            if stop.is_set():
                break
            if entry is None:
                continue
            value = None if entry.operation in ("DEL", "PURGE") else (entry.value or b"")
            view.apply(entry.key, value)
            router.update(view)
    finally:
        await client.close()


async def fresh_bucket(js: JetStreamContext, subjects: Subjects) -> None:
    """An empty registry bucket holding one pool with one endpoint."""
    with contextlib.suppress(Exception):  # absent on the first round
        await js.delete_key_value(subjects.registry_bucket)
    kv = await js.create_key_value(bucket=subjects.registry_bucket, history=1)
    await kv.put(pool_key(POOL), encode(InferencePool(name=POOL, target_port=8000)))
    await kv.put(endpoints_key(POOL), encode(
        EndpointSet(pool=POOL, endpoints=(Endpoint("pod-a", "127.0.0.1", 8000),))))


async def publish(url: str, models: int) -> None:
    """Put ``models`` models into the bucket (run in a process of its own: the baseline blocks
    its own loop for minutes, and a publisher sharing it would time out)."""
    await publish_models(url, POOL, models, on_connected=lambda: print("publishing", flush=True))


def _raise_if_failed(consuming: asyncio.Task[None]) -> None:
    """Stop the round at once when the consumer died (its error, not a timeout minutes later)."""
    if consuming.done():
        consuming.result()
        raise RuntimeError("the consumer stopped before the burst was applied")


async def one_round(url: str, models: int, consumer: Consumer) -> Round:
    """Publish ``models`` models to a consumer that synced on an empty registry."""
    subjects = Subjects()
    client = await connect(NatsSettings(url=url), "bench-setup")
    await fresh_bucket(client.jetstream(), subjects)
    await client.close()
    router = TimedRouter(POOL, PodTable(stale_after=600.0), random.Random(1))
    stop = asyncio.Event()
    consuming = asyncio.create_task(consumer(url, subjects, RegistryView(), router, stop))
    last = f'{{"model": "m{models - 1}"}}'.encode()
    publisher: asyncio.subprocess.Process | None = None
    try:
        for _ in range(1000):  # up to 10 s for the consumer to sync (the endpoint is known)
            _raise_if_failed(consuming)
            if router.pods.endpoints:
                break
            await asyncio.sleep(0.01)
        publisher = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--publish-to", url, "--models", str(models),
            stdout=asyncio.subprocess.PIPE)
        assert publisher.stdout is not None
        await publisher.stdout.readline()  # connected: the burst starts now
        busy_before, updates_before = router.busy, router.updates
        start = time.perf_counter()
        deadline = start + APPLY_TIMEOUT
        with LoopStall() as stall:
            while True:
                result = router.route(last)
                if isinstance(result, Routed) and result.target_model != f"m{models - 1}":
                    break
                _raise_if_failed(consuming)
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"{models} models not applied in {APPLY_TIMEOUT} s")
                await asyncio.sleep(0.005)
            wall = time.perf_counter() - start
        if await publisher.wait() != 0:
            raise RuntimeError("the publisher failed")
        return Round(wall, router.busy - busy_before, stall.worst,
                     router.updates - updates_before)
    finally:
        if publisher is not None and publisher.returncode is None:
            publisher.kill()
            await publisher.wait()
        stop.set()
        await asyncio.wait({consuming}, timeout=5)


async def run(url: str, models: int, rounds: int, baseline_rounds: int) -> dict[str, list[Round]]:
    """Every round of both consumers."""
    results: dict[str, list[Round]] = {"incremental": [], "rebuild per entry": []}
    for name, consumer, count in (("incremental", incremental, rounds),
                                  ("rebuild per entry", rebuild_per_entry, baseline_rounds)):
        for _ in range(count):
            results[name].append(await one_round(url, models, consumer))
            print(f"  {name}: {results[name][-1]}", file=sys.stderr)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=int, default=2000, help="models in the burst")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the picker's wiring")
    parser.add_argument("--baseline-rounds", type=int, default=3,
                        help="rounds of the rebuild-per-entry baseline")
    parser.add_argument("--publish-to", metavar="NATS_URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.publish_to:  # the publisher process of one round
        asyncio.run(publish(args.publish_to, args.models))
        return 0
    with tempfile.TemporaryDirectory() as store:
        server = NatsServer(Path(store), port=free_port())
        server.start()
        try:
            results = asyncio.run(run(server.url, args.models, args.rounds,
                                      args.baseline_rounds))
        finally:
            server.stop()

    def median(name: str, field: str) -> float:
        return statistics.median(getattr(r, field) for r in results[name])

    print(f"{args.models} models put into the registry bucket (medians; rounds: "
          f"{args.rounds} / {args.baseline_rounds})")
    print(f"{'':20} {'applied after':>14} {'router CPU':>11} {'loop stall':>15} "
          f"{'updates':>8}")
    for name in results:
        print(f"{name:20} {median(name, 'wall'):13.2f}s {median(name, 'cpu'):10.3f}s "
              f"{median(name, 'stall'):14.3f}s {median(name, 'updates'):8.0f}")
    for field, label in (("wall", "applied after"), ("cpu", "router CPU"),
                         ("stall", "longest loop stall")):
        ratio = median("rebuild per entry", field) / max(median("incremental", field), 1e-9)
        print(f"baseline / incremental, {label}: {ratio:.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
