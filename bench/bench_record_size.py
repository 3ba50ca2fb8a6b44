"""Bytes per decision record: on the wire (msgpack, inside a RecordBatch) and in a `lig record`
file (zlib level 6 over the batches, as the file's body compresses them).

Records come from the picker's real Router (the default policy, ``prefix-aware``, pods with
varied metrics, a weighted model split, a short completion prompt) for pools of 2, 8, 32 and 128
pods, published the way the picker publishes them (up to 256 records per batch). Baseline: the
decision stream's RoutedEvent of the same requests (what peers already get), in the same run.

Run: ``.venv/bin/python bench/bench_record_size.py [--requests 2000]``
"""

from __future__ import annotations

import argparse
import random
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.flags import at_least
from scheduling.record import DecisionRecord, OutcomeRecord, Record, RecordBatch
from services.picker.pools import Gateway, ResponseSeen
from services.picker.routing import Routed, Router
from services.picker.state import PodTable
from shared.registry_view import RegistryView
from shared.schemas import (
    DecisionBatch,
    DecisionEvent,
    Endpoint,
    EndpointSet,
    InferenceModel,
    InferencePool,
    PodMetrics,
    RoutedEvent,
    TargetModel,
    encode,
)

POOL = "bench"
BATCH = 256  # records per message, as services/picker/batch_sender.py sends them


def gateway(pods: int, records: list[Record], events: list[DecisionEvent]) -> Gateway:
    table = PodTable(stale_after=3600.0)
    router = Router(POOL, table, random.Random(3))
    built = Gateway([POOL], lambda pool: router, on_decision=lambda pool, e: events.append(e),
                    on_record=lambda pool, record: records.append(record))
    view = RegistryView()
    view.pools[POOL] = InferencePool(POOL, 8000)
    view.models[POOL] = {"chat": InferenceModel("chat", POOL, target_models=(
        TargetModel("chat-lora-a", 3), TargetModel("chat-lora-b", 1)))}
    endpoints = tuple(Endpoint(f"vllm-{i}", f"10.1.{i // 200}.{i % 200 + 1}", 8000)
                      for i in range(pods))
    view.endpoints[POOL] = EndpointSet(POOL, endpoints)
    built.update(view)
    rng = random.Random(1)
    for seq, endpoint in enumerate(endpoints, 1):
        table.apply(PodMetrics(POOL, endpoint.name, endpoint.hostport, seq, seq, 0.01, True,
                               waiting=rng.randrange(8), running=rng.randrange(32),
                               kv_cache_usage=rng.random(),
                               running_adapters=("chat-lora-a",) if seq % 2 else (),
                               max_lora=4))
    return built


def measure(pods: int, requests: int) -> tuple[float, float, float, float]:
    records: list[Record] = []
    events: list[DecisionEvent] = []
    built = gateway(pods, records, events)
    body = b'{"model": "chat", "prompt": "Write a haiku about load balancing.", "max_tokens": 64}'
    for number in range(requests):
        routed = built.route(body, request_id=f"{random.getrandbits(128):032x}")
        assert isinstance(routed, Routed)
        built.started(routed)
        built.finished(routed, 12, 64, ResponseSeen(200, routed.decided_ns + number))
    decisions: list[Record] = [r for r in records if isinstance(r, DecisionRecord)]
    outcomes: list[Record] = [r for r in records if isinstance(r, OutcomeRecord)]
    wire = file = 0
    for start in range(0, len(decisions), BATCH):
        payload = encode(RecordBatch("picker-1", POOL, 1, decisions[start:start + BATCH]))
        wire += len(payload)
        file += len(zlib.compress(payload, 6))
    outcome_wire = sum(len(encode(RecordBatch("picker-1", POOL, 1, outcomes[s:s + BATCH])))
                       for s in range(0, len(outcomes), BATCH))
    routed_events: list[DecisionEvent] = [e for e in events if isinstance(e, RoutedEvent)]
    event_wire = sum(len(encode(DecisionBatch("picker-1", POOL, 1, routed_events[s:s + BATCH])))
                     for s in range(0, len(routed_events), BATCH))
    count = len(decisions)
    return wire / count, file / count, outcome_wire / len(outcomes), event_wire / count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=at_least(1), default=2000,
                        help="requests routed per pool size (default: 2000)")
    args = parser.parse_args()
    print(f"bench_record_size: {args.requests} requests per pool size, {BATCH} records a batch")
    print(f"{'pods':>5} {'decision B (wire)':>18} {'decision B (zlib)':>18} "
          f"{'outcome B (wire)':>17} {'routed event B':>15} {'decision/event':>15}")
    for pods in (2, 8, 32, 128):
        decision, compressed, outcome, event = measure(pods, args.requests)
        print(f"{pods:5d} {decision:18.0f} {compressed:18.0f} {outcome:17.0f} {event:15.0f} "
              f"{decision / event:14.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
