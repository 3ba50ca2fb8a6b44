"""KV-cache events end to end: ``lig sim`` publishing them, ``lig kv-events`` republishing block
changes, a real nats-server; all ZMQ sockets on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import zmq
from nats.aio.client import Client
from nats.aio.msg import Msg

from scheduling import lig_sim_tokenizer as tokenizer
from shared import kv_blocks
from shared.kv_blocks import KVBlockChanges
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, encode_payload
from shared.subjects import Subjects
from tests.support.kv_events import PROMPT, EventPods, counter, gauge, register
from tests.support.nats_sync import subscribed
from tests.support.ports import free_port, free_port_range
from tests.support.processes import die_with_parent
from tests.support.simulator import REPO_ROOT
from tests.support.waiting import eventually

SUBJECTS = Subjects()
HEARTBEAT_S = 0.2


class ChangeLog:
    """Every block-change message on ``lig.kvblocks.>``, decoded, in arrival order."""

    def __init__(self) -> None:
        self.received: list[KVBlockChanges] = []

    async def on_message(self, msg: Msg) -> None:
        self.received.append(kv_blocks.decode(msg.data))

    def of(self, pod_name: str) -> list[KVBlockChanges]:
        return [c for c in self.received if c.pod == pod_name]

    def stored(self, pod_name: str) -> list[BlockStored]:
        return [op for c in self.of(pod_name) for op in c.ops if isinstance(op, BlockStored)]

    def seqs(self, pod_name: str) -> list[int]:
        return [c.source_seq for c in self.of(pod_name) if c.source_seq >= 0]


@contextlib.asynccontextmanager
async def change_log(nc: Client) -> AsyncIterator[ChangeLog]:
    log = ChangeLog()
    sub = await subscribed(nc, SUBJECTS.all_kv_blocks(), cb=log.on_message)
    try:
        yield log
    finally:
        await sub.unsubscribe()


@contextlib.contextmanager
def kv_events_process(nats_url: str, pods: EventPods | None, *flags: str,
                      events_port: str | None = None, replay_port: str | None = None,
                      ) -> Iterator[tuple[subprocess.Popen[bytes], int, Any]]:
    """``lig kv-events`` as a subprocess, its ports relative to the simulated pods' ports
    (heartbeats every 0.2 s: it follows its pods 0.2 s after connecting)."""
    metrics_port = free_port()
    if pods is not None:
        events_port = f"{pods.events_base - pods.ports[0]:+d}"
        replay_port = f"{pods.replay_base - pods.ports[0]:+d}"
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [sys.executable, "-m", "lig.cli", "kv-events", "--nats-url", nats_url,
         "--events-port", str(events_port), "--replay-port", str(replay_port),
         "--host", "127.0.0.1", "--metrics-port", str(metrics_port), "--replay-timeout", "1",
         "--heartbeat", str(HEARTBEAT_S), *flags],
        cwd=REPO_ROOT, env=os.environ | {"PYTHONPATH": str(REPO_ROOT)}, stdout=log,
        stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    try:
        yield process, metrics_port, log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


def output(log: Any) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")


async def followed(metrics_port: int, pods: int, log: Any) -> None:
    """Wait until the bridge follows ``pods`` pod streams: connected and replayed, so every
    batch published from now on reaches it (no time to guess)."""
    await eventually(lambda: gauge(metrics_port, "lig_kv_events_pods_followed") == pods,
                     within=15, what=f"{pods} pod stream(s) followed\n{output(log)}")


@pytest.mark.parametrize(("encoding", "hashes"), [("map", "int"), ("map", "bytes"),
                                                   ("array", "int")])
async def test_a_request_arrives_as_block_changes_of_its_pod(
    nc: Client, nats_server: Any, encoding: str, hashes: str
) -> None:
    """vLLM 0.33's events (maps, uint64 or 32-byte hashes) and vLLM 0.23's (arrays)."""
    with EventPods(2, encoding, hashes=hashes) as pods:
        await register(nc, [("pod-0", pods.ports[0]), ("pod-1", pods.ports[1])])
        async with change_log(nc) as changes:
            with kv_events_process(nats_server.url, pods) as (process, metrics_port, log):
                await followed(metrics_port, 2, log)
                await asyncio.to_thread(pods.complete, 1)
                await eventually(lambda: changes.stored("pod-1"), within=15,
                                 what=f"block changes of pod-1\n{output(log)}")
                stored = changes.stored("pod-1")
                # The prompt's own full blocks, with the simulator's token ids, in order.
                ids = [token for op in stored for token in op.token_ids]
                prompt_ids = list(tokenizer.encode(PROMPT))
                full = len(prompt_ids) // 16 * 16
                assert ids[:full] == prompt_ids[:full]
                assert stored[0].parent_block_hash is None and stored[0].block_size == 16
                # A parent names the block before it, in either hash type.
                assert all(later.parent_block_hash == earlier.block_hashes[-1]
                           for earlier, later in itertools.pairwise(stored))
                # Only the map form carries the KV-cache group's kind.
                assert {(op.group_idx, op.kind) for op in stored} == (
                    {(0, "full_attention")} if encoding == "map" else {(0, None)})
                first = changes.of("pod-1")[0]
                assert first.address == pods.address(1) and first.pool == "pool-a"
                assert changes.of("pod-0") == []
                process.send_signal(signal.SIGTERM)
                started = time.monotonic()
                assert await asyncio.to_thread(process.wait, 10) == 0
                assert time.monotonic() - started < 5


@pytest.mark.parametrize("framing", ["topic", "legacy"])
async def test_batches_missed_before_subscribing_and_mid_stream_are_replayed(
    nc: Client, nats_server: Any, framing: str
) -> None:
    """Replay replies with the topic frame (vLLM 0.26 and later) and without (before)."""
    with EventPods(1, "map", framing=framing) as pods:
        await register(nc, [("pod-0", pods.ports[0])])
        # Published before anyone listens: the consumer's first replay brings it.
        await asyncio.to_thread(pods.complete, 0, "hello world " * 30)
        async with change_log(nc) as changes:
            with kv_events_process(nats_server.url, pods) as (_, metrics_port, log):
                await eventually(lambda: changes.seqs("pod-0"), within=15,
                                 what=f"replayed changes\n{output(log)}")
                # The PUB socket loses the next batches; the one after shows the gap.
                before = pods.drop_next(0, 2)["seq"]
                for index in range(4):
                    await asyncio.to_thread(pods.complete, 0, f"prompt number {index} " * 20)
                await eventually(lambda: len(changes.seqs("pod-0")) > before + 3, within=15,
                                 what=f"changes after the gap\n{output(log)}")
                seqs = changes.seqs("pod-0")
                assert seqs == list(range(len(seqs))), seqs
                assert not any(c.resync for c in changes.of("pod-0"))
                assert counter(metrics_port, "lig_kv_events_batches_total",
                               '{outcome="gap"}') >= 1
                assert counter(metrics_port, "lig_kv_events_resyncs_total") == 0
                assert counter(metrics_port, "lig_kv_events_batches_total",
                               '{outcome="replay_malformed"}') == 0


async def test_a_gap_replay_cannot_cover_publishes_a_resync_marker(
    nc: Client, nats_server: Any
) -> None:
    with EventPods(1, "array", buffer_steps=1) as pods:
        await register(nc, [("pod-0", pods.ports[0])])
        async with change_log(nc) as changes:
            with kv_events_process(nats_server.url, pods) as (_, metrics_port, log):
                await followed(metrics_port, 1, log)
                await asyncio.to_thread(pods.complete, 0, "alpha beta " * 30)
                await eventually(lambda: changes.seqs("pod-0"), within=15,
                                 what=f"first changes\n{output(log)}")
                pods.drop_next(0, 3)
                for index in range(5):
                    await asyncio.to_thread(pods.complete, 0, f"lost text {index} " * 20)
                await eventually(lambda: any(c.resync for c in changes.of("pod-0")), within=15,
                                 what=f"a resync marker\n{output(log)}")
                marker = next(c for c in changes.of("pod-0") if c.resync)
                assert marker.ops == [AllBlocksCleared()] and marker.source_seq == -1
                assert counter(metrics_port, "lig_kv_events_resyncs_total") >= 1


async def test_a_malformed_flood_is_counted_and_skipped(nc: Client, nats_server: Any) -> None:
    """A pod (here a bare ZMQ PUB socket) sends garbage between good batches: the garbage is
    counted, the good batches still arrive, and the consumer keeps running."""
    port = free_port()
    await register(nc, [("pod-x", port)])
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.linger = 0
    pub.bind(f"tcp://127.0.0.1:{port}")
    flood = 2_000
    try:
        async with change_log(nc) as changes:
            with kv_events_process(nats_server.url, None, events_port=str(port),
                                   replay_port="none") as (process, metrics_port, log):
                await eventually(lambda: any(c.resync for c in changes.of("pod-x")), within=15,
                                 what=f"the start marker (no replay: state unknown)\n{output(log)}")
                await followed(metrics_port, 1, log)
                good = encode_payload(1.0, [BlockRemoved((7,), "GPU")], "map")
                pub.send_multipart([b"kv", (0).to_bytes(8, "big"), good])
                deadline = time.monotonic() + 20
                for index in range(flood):
                    garbage = [b"kv", (index + 1).to_bytes(8, "big"), b"\xc1" + bytes(index % 50)]
                    pub.send_multipart(garbage if index % 3 else [b"only one frame"])
                    if index % 200 == 0:
                        await asyncio.sleep(0.01)
                    assert time.monotonic() < deadline
                pub.send_multipart([b"kv", (flood + 1).to_bytes(8, "big"), good])
                await eventually(lambda: len(changes.seqs("pod-x")) == 2, within=20,
                                 what=f"both good batches\n{output(log)}")
                skipped = counter(metrics_port, "lig_kv_events_skipped_total",
                                  '{reason="msgpack"}') + counter(
                    metrics_port, "lig_kv_events_skipped_total", '{reason="frames"}')
                assert skipped == flood
                assert process.poll() is None
                assert changes.seqs("pod-x") == [0, flood + 1]
    finally:
        pub.close()
        ctx.term()


async def test_a_restarted_engine_clears_the_pod_and_its_new_stream_is_followed(
    nc: Client, nats_server: Any
) -> None:
    with EventPods(1, "map") as pods:
        await register(nc, [("pod-0", pods.ports[0])])
        async with change_log(nc) as changes:
            with kv_events_process(nats_server.url, pods) as (_, metrics_port, log):
                await followed(metrics_port, 1, log)
                for index in range(3):
                    await asyncio.to_thread(pods.complete, 0, f"before restart {index} " * 20)
                await eventually(lambda: len(changes.seqs("pod-0")) >= 3, within=15,
                                 what=f"changes before the restart\n{output(log)}")
                before = len(changes.of("pod-0"))
                await asyncio.to_thread(pods.restart)
                await asyncio.to_thread(pods.complete, 0, "after the restart " * 20)

                def cleared_then_stored() -> bool:
                    after = changes.of("pod-0")[before:]
                    return any(c.ops == [AllBlocksCleared()] for c in after) and any(
                        c.source_seq == 0 for c in after)

                await eventually(cleared_then_stored, within=20,
                                 what=f"a clear and the new engine's batches\n{output(log)}")
                after = changes.of("pod-0")[before:]
                marker = next(i for i, c in enumerate(after) if c.ops == [AllBlocksCleared()])
                first_new = next(i for i, c in enumerate(after) if c.source_seq == 0)
                assert marker < first_new and not after[marker].resync
                stored = [op for c in after[first_new:] for op in c.ops
                          if isinstance(op, BlockStored)]
                assert list(tokenizer.encode("after the restart " * 20))[:16] == list(
                    stored[0].token_ids[:16])
                assert counter(metrics_port, "lig_kv_events_batches_total",
                               '{outcome="reset"}') == 1


@pytest.mark.parametrize("beyond", [0, 2])
async def test_a_restarted_engine_whose_first_batches_are_lost_is_still_seen_restarting(
    nc: Client, nats_server: Any, beyond: int
) -> None:
    """The old engine sent batches 0..n-1. The restarted engine's first batches never reach
    the PUB socket (as when they are sent before the subscriber has reconnected), so its first
    batch heard carries exactly the sequence expected from the old engine, n (``beyond`` 0), or
    a later one (2: it looks like a gap). Neither may pass for the old stream going on: the
    pod is cleared and the new stream followed from 0."""
    with EventPods(1, "map") as pods:
        await register(nc, [("pod-0", pods.ports[0])])
        async with change_log(nc) as changes:
            with kv_events_process(nats_server.url, pods) as (_, metrics_port, log):
                await followed(metrics_port, 1, log)
                old = 0
                while old < 3:  # a request makes one or two batches
                    await asyncio.to_thread(pods.complete, 0, f"old engine {old} " * 20)
                    old = pods.kv_event_state(0)["seq"] + 1
                await eventually(lambda: changes.seqs("pod-0") == list(range(old)), within=15,
                                 what=f"the old engine's changes\n{output(log)}")
                lost = old + beyond
                before = len(changes.of("pod-0"))
                await asyncio.to_thread(pods.restart)
                pods.drop_next(0, lost)
                deadline = time.monotonic() + 30
                index = 0
                while pods.kv_event_state(0)["seq"] < lost:  # bounded: 30 s
                    assert time.monotonic() < deadline, pods.output()
                    await asyncio.to_thread(pods.complete, 0, f"new engine {index} " * 20)
                    index += 1
                newest = pods.kv_event_state(0)["seq"]

                def new_stream() -> list[int]:
                    return [c.source_seq for c in changes.of("pod-0")[before:]
                            if c.source_seq >= 0]

                await eventually(lambda: new_stream() == list(range(newest + 1)), within=20,
                                 what=f"the new engine's whole stream, got {new_stream()}"
                                      f"\n{output(log)}")
                after = changes.of("pod-0")[before:]
                assert after[0].ops == [AllBlocksCleared()] and after[0].source_seq == -1
                assert not any(c.resync for c in after)
                stored = [op for c in after for op in c.ops if isinstance(op, BlockStored)]
                assert list(tokenizer.encode("new engine 0 " * 20))[:16] == list(
                    stored[0].token_ids[:16])
                assert counter(metrics_port, "lig_kv_events_batches_total",
                               '{outcome="reset"}') == 1


async def test_a_pod_whose_replay_fails_is_resynced_once_and_followed_from_its_next_batch(
    nc: Client, nats_server: Any
) -> None:
    """No replay answers (nothing listens on the replay port): the start is one resync marker,
    and the first batch heard starts the stream; it must not look like a gap to replay again."""
    port, dead_replay_port = free_port(), free_port()
    await register(nc, [("pod-y", port)])
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.linger = 0
    pub.bind(f"tcp://127.0.0.1:{port}")
    try:
        async with change_log(nc) as changes:
            with kv_events_process(nats_server.url, None, events_port=str(port),
                                   replay_port=str(dead_replay_port)) as (_, metrics_port, log):
                await eventually(lambda: any(c.resync for c in changes.of("pod-y")), within=15,
                                 what=f"the start marker\n{output(log)}")
                await followed(metrics_port, 1, log)
                good = encode_payload(1.0, [BlockRemoved((7,), "GPU")], "array")
                for seq in (5, 6):
                    pub.send_multipart([b"kv", seq.to_bytes(8, "big"), good])
                await eventually(lambda: changes.seqs("pod-y") == [5, 6], within=15,
                                 what=f"both batches\n{output(log)}")
                assert sum(c.resync for c in changes.of("pod-y")) == 1
                assert counter(metrics_port, "lig_kv_events_batches_total",
                               '{outcome="gap"}') == 0
    finally:
        pub.close()
        ctx.term()


@pytest.mark.parametrize("framing", ["topic", "legacy"])
def test_the_simulators_replay_socket_answers_vllms_protocol_and_ignores_garbage(
    framing: str
) -> None:
    """vLLM 0.26 and later: ``["", topic, seq, payload]``, ending ``["", "", END, ""]``;
    before: ``["", seq, payload]``, ending ``["", END, ""]`` (what a DEALER receives)."""
    topic = [b"kv"] if framing == "topic" else []
    with EventPods(1, "array", framing=framing) as pods:
        pods.complete(0, "one two three " * 20)
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.rcvtimeo = 5000
        dealer.connect(f"tcp://127.0.0.1:{pods.replay_base}")
        try:
            dealer.send_multipart([b"", b"short"])  # not 8 bytes: ignored
            dealer.send_multipart([b"garbage"])  # not [empty, seq]: ignored
            dealer.send_multipart([b"", (1).to_bytes(8, "big")])
            replies = []
            while True:
                frames = dealer.recv_multipart()
                replies.append(frames)
                if frames[-2] == b"\xff" * 8:
                    break
                assert len(replies) < 1000
            assert replies[-1] == [b"", *[b"" for _ in topic], b"\xff" * 8, b""]
            assert all(frames[:1 + len(topic)] == [b"", *topic] and len(frames) == 3 + len(topic)
                       and frames[-1] for frames in replies[:-1])
            seqs = [int.from_bytes(frames[-2], "big") for frames in replies[:-1]]
            assert seqs and seqs == list(range(1, len(seqs) + 1))
        finally:
            dealer.close()
            ctx.term()
        assert "Traceback" not in pods.output()


async def test_data_parallel_ranks_are_followed_on_their_own_ports(
    nc: Client, nats_server: Any
) -> None:
    """A pod with two data-parallel ranks (vLLM: rank r on the port + r), each numbering its
    batches from 0: both streams arrive, told apart by ``dp_rank``."""
    base = free_port_range(2)
    await register(nc, [("pod-dp", 9000)])
    ctx = zmq.Context()
    pubs = []
    for rank in range(2):
        pub = ctx.socket(zmq.PUB)
        pub.linger = 0
        pub.bind(f"tcp://127.0.0.1:{base + rank}")
        pubs.append(pub)
    try:
        async with change_log(nc) as changes:
            with kv_events_process(nats_server.url, None, "--dp-ranks", "2",
                                   events_port=f"{base - 9000:+d}",
                                   replay_port="none") as (_, metrics_port, log):
                await eventually(lambda: {c.dp_rank for c in changes.of("pod-dp")} == {0, 1},
                                 within=15, what=f"both ranks' start markers\n{output(log)}")
                await followed(metrics_port, 2, log)
                for rank, pub in enumerate(pubs):
                    for seq in range(2):
                        stored = BlockStored((100 * rank + seq,), None, (), 16, None, "GPU")
                        pub.send_multipart([b"kv", seq.to_bytes(8, "big"),
                                            encode_payload(1.0 + seq, [stored], "map", rank)])
                await eventually(lambda: len(changes.seqs("pod-dp")) == 4, within=15,
                                 what=f"both ranks' batches\n{output(log)}")
                by_rank = {rank: [op.block_hashes for c in changes.of("pod-dp")
                                  if c.dp_rank == rank and c.source_seq >= 0 for op in c.ops]
                           for rank in range(2)}
                assert by_rank == {0: [(0,), (1,)], 1: [(100,), (101,)]}
                assert not any(c.ops == [AllBlocksCleared()] and not c.resync
                               for c in changes.of("pod-dp"))  # no rank looked restarted
    finally:
        for pub in pubs:
            pub.close()
        ctx.term()


async def test_replicas_share_the_pods_and_a_dead_ones_pods_keep_their_events(
    nc: Client, nats_server: Any
) -> None:
    """Two bridges share six pods by heartbeats; one is killed (no goodbye): within two
    heartbeats the other follows its pods too, and their new blocks keep arriving."""
    names = [f"pod-{i}" for i in range(6)]

    def pods_of(metrics_port: int) -> float:  # followed: connected and replayed
        return gauge(metrics_port, "lig_kv_events_pods_followed")

    with EventPods(len(names), "map") as pods:
        await register(nc, [(name, pods.ports[i]) for i, name in enumerate(names)])
        async with change_log(nc) as changes:
            with kv_events_process(nats_server.url, pods, "--replica-id", "kv-a") as (
                    _, port_a, log_a), \
                    kv_events_process(nats_server.url, pods, "--replica-id", "kv-b") as (
                    process_b, port_b, log_b):
                await eventually(
                    lambda: pods_of(port_a) + pods_of(port_b) == len(names)
                    and gauge(port_a, "lig_kv_events_replicas") == 2
                    and gauge(port_b, "lig_kv_events_replicas") == 2, within=15,
                    what=f"the pods shared\n{output(log_a)}\n{output(log_b)}")
                owned_by_b = pods_of(port_b)
                assert 0 < owned_by_b < len(names)  # both replicas follow some pods
                for index in range(len(names)):
                    await asyncio.to_thread(pods.complete, index, f"before {index} " * 20)
                await eventually(lambda: all(changes.stored(name) for name in names),
                                 within=15, what=f"every pod's changes\n{output(log_a)}")

                process_b.kill()  # dead: no goodbye heartbeat
                killed = time.monotonic()
                await eventually(lambda: pods_of(port_a) == len(names), within=10,
                                 what=f"kv-a following every pod\n{output(log_a)}")
                took = time.monotonic() - killed
                heard = {name: len(changes.stored(name)) for name in names}
                for index in range(len(names)):
                    await asyncio.to_thread(pods.complete, index, f"after {index} " * 20)
                await eventually(
                    lambda: all(len(changes.stored(name)) > heard[name] for name in names),
                    within=15, what=f"every pod's changes after the kill\n{output(log_a)}")
                assert counter(port_a, "lig_kv_events_replicas") == 1
                assert not any(c.resync for c in changes.received)  # replays covered all
    # Expiry after 1.5 heartbeats, checked every eighth: well within a second here.
    assert took < 5, took
