"""The decision stream's costs: what publishing adds per request, what applying costs per event.

Two measurements, each a median of ``--rounds`` CPU-time runs (``time.process_time``), with a
baseline measured in the same run:

- **publish, per request**: route a request, count it started and finished through the picker's
  :class:`~services.picker.pools.Gateway` (8 pods), ``--window`` requests per batch window, then
  let the :class:`~services.picker.batch_sender.BatchSender` publish the window to a real
  nats-server (encode + nats-py publish, everything the sender does). Baseline: the same requests
  through a gateway without the stream (``--no-shared-decisions``). The difference is what
  publishing adds per request (the issue's budget: 10 us).
- **apply, per event**: decode a peer's batch (``--window`` routed events, then as many
  finished) and apply it to a gateway, as the picker's subscriber does. Baseline: the same
  bookkeeping for the picker's own requests (``PodTable.started`` / ``finished``, no decoding).
  The issue's budget: 5 us per event on average.

Run: ``.venv/bin/python bench/bench_decision_stream.py [--requests 20000] [--rounds 7]``
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nats

from services.picker.batch_sender import BatchQueue, BatchSender
from services.picker.decision_stream import DecisionSink, decision_queue
from services.picker.pools import Gateway
from services.picker.routing import Routed, Router
from services.picker.state import PodTable
from shared.registry_view import RegistryView
from shared.schemas import (
    Criticality,
    DecisionBatch,
    DecisionEvent,
    Endpoint,
    EndpointSet,
    FinishedEvent,
    InferenceModel,
    InferencePool,
    PodMetrics,
    RoutedEvent,
    encode,
)
from shared.subjects import Subjects
from tests.support.nats_server import NatsServer

POOL = "bench"
PODS = 8
BODY = b'{"model": "m", "prompt": "Write a haiku about load balancing.", "max_tokens": 64}'


def build_gateway(on_decision: BatchQueue[DecisionEvent] | None, picker_id: str = "me"
                  ) -> Gateway:
    """A one-pool gateway of ``PODS`` fresh, idle pods (the picker's real classes)."""
    pods = PodTable(stale_after=3600.0)
    router = Router(POOL, pods, random.Random(7))
    gateway = Gateway([POOL], lambda pool: router, on_decision=on_decision, picker_id=picker_id)
    endpoints = tuple(Endpoint(f"pod-{i}", f"10.0.0.{i + 1}", 8000) for i in range(PODS))
    view = RegistryView()
    view.pools[POOL] = InferencePool(POOL, 8000)
    view.models[POOL] = {"m": InferenceModel("m", POOL)}
    view.endpoints[POOL] = EndpointSet(POOL, endpoints)
    gateway.update(view)
    for seq, endpoint in enumerate(endpoints, 1):
        pods.apply(PodMetrics(POOL, endpoint.name, endpoint.hostport, seq, seq, 0.01, True,
                              waiting=0, running=2, kv_cache_usage=0.2))
    return gateway


async def publish_round(url: str | None, requests: int, window: int) -> float:
    """CPU seconds per request: route + started + finished, and (with ``url``) the sender's
    publishing of every window to NATS."""
    client = await nats.connect(url) if url is not None else None
    sender = BatchSender("bench", heartbeat=3600.0)
    publisher = decision_queue(sender, Subjects()) if client is not None else None
    gateway = build_gateway(publisher)
    route, started, finished = gateway.route, gateway.started, gateway.finished
    try:
        start = time.process_time()
        for _ in range(requests // window):
            routed = []
            for _ in range(window):
                decision = route(BODY)
                assert isinstance(decision, Routed)
                started(decision)
                routed.append(decision)
            for decision in routed:
                finished(decision)
            if publisher is not None and client is not None:
                await sender.flush(client)
        if client is not None:
            await client.flush()
        return (time.process_time() - start) / requests
    finally:
        if client is not None:
            await client.close()


def peer_payloads(pairs: int, window: int) -> list[bytes]:
    """A peer's batches, as they arrive on NATS: ``pairs`` times a batch of ``window`` routed
    events followed by one finishing them (so the counts stay bounded)."""
    payloads = []
    for pair in range(pairs):
        ids = range(pair * window, (pair + 1) * window)
        pods = [f"pod-{i % PODS}" for i in ids]
        routed: list[DecisionEvent] = [RoutedEvent(i, pod, "m", Criticality.STANDARD, 12, 64)
                                       for i, pod in zip(ids, pods, strict=True)]
        finished: list[DecisionEvent] = [FinishedEvent(i, pod, 12, 64)
                                         for i, pod in zip(ids, pods, strict=True)]
        payloads.append(encode(DecisionBatch("peer", POOL, time.time_ns(), routed)))
        payloads.append(encode(DecisionBatch("peer", POOL, time.time_ns(), finished)))
    return payloads


def apply_round(payloads: list[bytes], window: int) -> float:
    """CPU seconds per event: decode and apply each payload as the subscriber does."""
    gateway = build_gateway(None)
    sink = DecisionSink(gateway.apply_peer)
    accept = sink.accept
    subject = Subjects().decisions(POOL)
    start = time.process_time()
    for payload in payloads:
        accept(subject, payload)
    elapsed = time.process_time() - start
    assert gateway.peers.applied == len(payloads) * window
    return elapsed / gateway.peers.applied


def own_bookkeeping_round(events: int) -> float:
    """CPU seconds per event of the picker's own bookkeeping (started or finished)."""
    table = build_gateway(None).table(POOL)
    assert table is not None
    names = [f"pod-{i % PODS}" for i in range(events // 2)]
    start = time.process_time()
    for name in names:
        table.started(name)
    for name in names:
        table.finished(name)
    return (time.process_time() - start) / (2 * len(names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per measurement")
    parser.add_argument("--window", type=int, default=16,
                        help="requests per batch window (16: 8,000 req/s at the 2 ms delay)")
    args = parser.parse_args()
    if args.requests < args.window or args.rounds < 1 or args.window < 1:
        raise SystemExit("--requests must be at least --window; --rounds and --window >= 1")

    with tempfile.TemporaryDirectory() as workdir:
        server = NatsServer(Path(workdir) / "nats")
        server.start()
        try:
            with_stream, without = [], []
            for _ in range(args.rounds):  # interleaved, so that noise hits both alike
                without.append(asyncio.run(publish_round(None, args.requests, args.window)))
                with_stream.append(asyncio.run(publish_round(server.url, args.requests,
                                                             args.window)))
        finally:
            server.stop()
    payloads = peer_payloads(max(1, args.requests // args.window // 2), args.window)
    applied, own = [], []
    for _ in range(args.rounds):
        own.append(own_bookkeeping_round(args.requests))
        applied.append(apply_round(payloads, args.window))

    base, shared = statistics.median(without), statistics.median(with_stream)
    apply_cost, own_cost = statistics.median(applied), statistics.median(own)
    us = 1e6
    print(f"decision stream costs, medians of {args.rounds} rounds of {args.requests} requests "
          f"({args.window} per batch window, {PODS} pods), CPU time:")
    print(f"{'':36} {'us':>9} {'baseline us':>12} {'ratio':>7}")
    print(f"{'request, decision stream on':36} {shared * us:9.2f} {base * us:12.2f} "
          f"{shared / base:7.2f}x   (baseline: --no-shared-decisions)")
    print(f"{'publishing adds per request':36} {(shared - base) * us:9.2f} "
          f"{'':12} {'':7}   budget 10 us")
    print(f"{'peer event decoded + applied':36} {apply_cost * us:9.2f} {own_cost * us:12.2f} "
          f"{apply_cost / own_cost:7.2f}x   (baseline: own started/finished); budget 5 us")


if __name__ == "__main__":
    main()
