"""vLLM's own KV-event publisher against ``lig kv-events``: is every event relayed?

    .venv/bin/python bench/check_vllm_kv_events.py --wheel vllm-0.33.0-...whl [--rank 4]
    .venv/bin/python bench/check_vllm_kv_events.py --wheel W \
        --write-fixtures tests/fixtures/vllm_kv_events

Not a speed benchmark: a conformance check that needs a vLLM wheel (``pip download --no-deps
vllm==0.33.0``; 330 MB, so the suite does not fetch it). vLLM's ``ZmqEventPublisher`` and event
classes run unchanged (tests/support/vllm_kv_events.py), on loopback, against a real nats-server
and ``lig kv-events``. For each hash type (uint64, 32-byte digests) it publishes batches of a
hybrid model's events (a full-attention and a sliding-window group, adapters named and by id
only, removals of one group, a cache reset):

1. batches published before the bridge subscribes (its first replay must bring them),
2. batches while it follows, three of them lost on the PUB socket (vLLM's replay buffer keeps
   them: the gap must be replayed),
3. batches while the bridge is stopped, then restarted (its replay from 0 must bring them),

and counts the events relayed on NATS against those published, with the bridge's resync and
replay counters. Exit status 1 if an event is missing, altered, or a resync happened.

``--write-fixtures DIR`` writes instead what vLLM's classes encode (payloads) and what its
replay socket sends (frames, as a DEALER receives them), hex in JSON, for the suite's
``tests/test_kv_events_vllm_fixtures.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import zmq
from nats.aio.client import Client

from shared import kv_blocks
from shared.kv_events import BlockStored, KVEventDecoder
from shared.schemas import InferencePool
from tests.support import vllm_kv_events
from tests.support.collector import pod, put_pool, registry_bucket
from tests.support.nats_server import NatsServer
from tests.support.ports import free_port, free_port_range
from tests.support.waiting import eventually

REPO = Path(__file__).resolve().parent.parent
BLOCK = 16


def batches(vllm: types.ModuleType, hashes: str, start: int, count: int) -> list[Any]:
    """``count`` event batches as a hybrid model's engine publishes them; block hashes from
    ``start`` on, so that every call names new blocks."""
    def digest(value: int) -> int | bytes:
        return value if hashes == "int" else value.to_bytes(32, "big")

    out = []
    for number in range(start, start + count):
        base = number * 10 + 1
        chain = [digest(base + offset) for offset in range(3)]
        tokens = list(range(number * 100, number * 100 + 3 * BLOCK))
        lora = ({"lora_id": 1, "lora_name": "sql-lora"} if number % 3 == 1 else
                {"lora_id": 2, "lora_name": None} if number % 3 == 2 else
                {"lora_id": None, "lora_name": None})
        events = [
            vllm.BlockStored(block_hashes=chain[:2], parent_block_hash=None,
                             token_ids=tokens[:2 * BLOCK], block_size=BLOCK, medium="GPU",
                             group_idx=0, kv_cache_spec_kind="full_attention", **lora),
            vllm.BlockStored(block_hashes=chain[2:], parent_block_hash=chain[1],
                             token_ids=tokens[2 * BLOCK:], block_size=BLOCK, medium="GPU",
                             group_idx=0, kv_cache_spec_kind="full_attention", **lora),
            vllm.BlockStored(block_hashes=chain, parent_block_hash=None, token_ids=tokens,
                             block_size=BLOCK, medium="GPU", group_idx=1,
                             kv_cache_spec_kind="sliding_window",
                             kv_cache_spec_sliding_window=BLOCK, **lora),
            vllm.BlockRemoved(block_hashes=chain[:1], medium="GPU", group_idx=1),
        ]
        if number % 7 == 6:
            events.append(vllm.AllBlocksCleared())
        out.append(vllm.KVEventBatch(ts=time.time(), events=events))
    return out


def expected_ops(vllm: types.ModuleType, sent: list[Any]) -> list[Any]:
    """The events of ``sent`` as lig decodes them (the reference for what must be relayed)."""
    decoder = KVEventDecoder()
    encoder = __import__("msgspec").msgpack.Encoder()
    ops: list[Any] = []
    for seq, batch in enumerate(sent):
        decoded = decoder.decode_payload(seq, encoder.encode(batch))
        assert decoded is not None and not decoded.skipped_events, decoder.skipped
        ops += decoded.events
    return ops


class Bridge:
    """``lig kv-events`` as a subprocess, following one pod whose rank ``rank`` publishes on
    ``events`` and ``replay`` (+ rank, as vLLM offsets them)."""

    def __init__(self, nats_url: str, events: int, replay: int, rank: int) -> None:
        self.metrics = free_port()
        self.args = [sys.executable, "-m", "lig.cli", "kv-events", "--nats-url", nats_url,
                     "--events-port", str(events), "--replay-port", str(replay),
                     "--dp-ranks", f"{rank}-{rank}", "--host", "127.0.0.1",
                     "--metrics-port", str(self.metrics), "--heartbeat", "0.2"]
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(self.args, cwd=REPO, stdout=self.log,
                                        stderr=subprocess.STDOUT,
                                        env=os.environ | {"PYTHONPATH": str(REPO)})

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None

    def counter(self, name: str, label: str = "") -> float:
        try:
            text = httpx.get(f"http://127.0.0.1:{self.metrics}/metrics", timeout=5.0).text
        except httpx.TransportError:
            return -1.0
        for line in text.splitlines():
            if line.startswith(name + label + " "):
                return float(line.split()[-1])
        return 0.0

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")


async def check(vllm: types.ModuleType, nats: NatsServer, hashes: str, rank: int) -> bool:
    """One run for one hash type; True when every event arrived as sent, with no resync."""
    base = free_port_range(2 * (rank + 1))
    events_port, replay_port = base, base + rank + 1
    nc = Client()
    await nc.connect(nats.url)
    relayed: list[Any] = []
    resyncs = 0

    async def on_changes(msg: Any) -> None:
        nonlocal resyncs
        changes = kv_blocks.decode(msg.data)
        if changes.resync:
            resyncs += 1
        elif changes.source_seq >= 0:
            relayed.extend(changes.ops)

    serving_port = free_port()
    await put_pool(await registry_bucket(nc), InferencePool(name="pool", target_port=serving_port),
                   [pod("vllm-0", serving_port)])
    await nc.subscribe("lig.kvblocks.>", cb=on_changes)
    publisher = vllm_kv_events.publisher(vllm, events_port, replay_port, rank)
    bridge = Bridge(nats.url, events_port, replay_port, rank)
    sent: list[Any] = []

    def publish(count: int) -> None:
        new = batches(vllm, hashes, len(sent), count)
        sent.extend(new)
        for batch in new:
            publisher.publish(batch)

    async def all_relayed(stage: str) -> None:
        want = len(expected_ops(vllm, sent))
        await eventually(lambda: len(relayed) >= want, within=30,
                         what=f"{stage}: {want} events relayed\n{bridge.output()}")

    try:
        publish(10)  # 1. before anyone subscribes
        await asyncio.sleep(0.5)  # vLLM's publisher thread sends from its queue
        bridge.start()
        await eventually(lambda: bridge.counter("lig_kv_events_pods_followed") == 1, within=30,
                         what=f"the pod followed\n{bridge.output()}")
        await all_relayed("before subscribing")
        publish(10)  # 2. while it follows,
        vllm_kv_events.drop_next(publisher, 3)  # three lost on the way, the next shows the gap
        publish(10)
        await all_relayed("following, with a gap")
        # Read before the restart, which starts the counters again.
        gaps = bridge.counter("lig_kv_events_batches_total", '{outcome="gap"}')
        unreadable = '{outcome="replay_malformed"}'
        malformed = bridge.counter("lig_kv_events_batches_total", unreadable)
        bridge.stop()
        publish(10)  # 3. while the bridge is down
        await asyncio.sleep(0.5)
        before = len(relayed)
        bridge.start()
        await eventually(lambda: bridge.counter("lig_kv_events_pods_followed") == 1, within=30,
                         what=f"the pod followed again\n{bridge.output()}")
        await eventually(lambda: len(relayed) - before >= len(expected_ops(vllm, sent)),
                         within=30, what=f"after the restart\n{bridge.output()}")
        # The restarted bridge replays from 0: everything once more, the last 10 batches new.
        again = relayed[before:]
        want = expected_ops(vllm, sent)
        malformed += bridge.counter("lig_kv_events_batches_total", unreadable)
        first_pass = relayed[:before]
        ok = first_pass == want[:len(first_pass)] and again == want and resyncs == 0 \
            and malformed == 0 and gaps >= 1
        sent_events = sum(len(batch.events) for batch in sent)
        stored = sum(isinstance(op, BlockStored) for op in want)
        print(f"{hashes:5} hashes, rank {rank}: vLLM published {len(sent)} batches, "
              f"{sent_events} events ({stored} BlockStored); relayed {len(first_pass)} + "
              f"{len(again)} after the bridge's restart (expected {len(want)}); gaps replayed "
              f"{gaps:g}; resyncs {resyncs}; unreadable replay replies {malformed:g}: "
              f"{'OK' if ok else 'MISMATCH'}")
        return ok
    finally:
        bridge.stop()
        bridge.log.close()
        publisher.shutdown()
        await nc.close()


def write_fixtures(vllm: types.ModuleType, out: Path) -> None:
    """vLLM's encoding of the same batches, and its replay socket's frames, as hex JSON."""
    import msgspec

    out.mkdir(parents=True, exist_ok=True)
    encoder = msgspec.msgpack.Encoder()
    for hashes in ("int", "bytes"):
        sent = batches(vllm, hashes, 0, 7)
        for batch in sent:
            batch.ts = 1_700_000_000.0  # fixed: the fixture is reproducible
        base = free_port_range(2)
        publisher = vllm_kv_events.publisher(vllm, base, base + 1)
        for batch in sent:
            publisher.publish(batch)
        time.sleep(0.5)
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.rcvtimeo = 5000
        dealer.connect(f"tcp://127.0.0.1:{base + 1}")
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        replies = []
        while True:
            frames = dealer.recv_multipart()
            replies.append([frame.hex() for frame in frames])
            if b"\xff" * 8 in frames:
                break
        dealer.close(linger=0)
        ctx.term()
        publisher.shutdown()
        wheel = Path(str(vllm.__file__).split("!")[0]).name
        fixture = {
            "source": f"vLLM's {vllm_kv_events.SOURCE} ({wheel}), by "
                      "bench/check_vllm_kv_events.py --write-fixtures",
            "hashes": hashes,
            "payloads": [encoder.encode(batch).hex() for batch in sent],
            "replay_from_2": replies,
        }
        path = out / f"batches_{hashes}.json"
        path.write_text(json.dumps(fixture, indent=1) + "\n")
        print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, required=True, help="a vLLM wheel (.whl)")
    parser.add_argument("--rank", type=int, default=0,
                        help="the publisher's data-parallel rank (global: ports + rank)")
    parser.add_argument("--write-fixtures", type=Path, default=None, metavar="DIR",
                        help="write vLLM's encoded batches and replay frames instead")
    args = parser.parse_args()
    vllm = vllm_kv_events.load(args.wheel)
    if args.write_fixtures is not None:
        write_fixtures(vllm, args.write_fixtures)
        return 0
    with tempfile.TemporaryDirectory() as store:
        nats = NatsServer(Path(store))
        nats.start()
        try:
            results = [asyncio.run(check(vllm, nats, hashes, args.rank))
                       for hashes in ("int", "bytes")]
        finally:
            nats.stop()
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
