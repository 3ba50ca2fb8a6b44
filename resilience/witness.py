"""The witness of the true block sets: every simulated pod's KV-cache events, read straight from
its ZMQ PUB socket, independently of ``lig kv-events`` and NATS.

It connects before any traffic (the stack's start waits for each SUB socket's handshake, seen
by a socket monitor), so it hears every batch a pod publishes and keeps each pod's cache as the
pod announced it: per rank, the set of block hashes, ``BlockStored`` adding, ``BlockRemoved``
removing, ``AllBlocksCleared`` clearing; GPU blocks only (vLLM's CPU tier re-announces the same
hashes). The chaos tool compares each picker's precise index with :meth:`BlockWitness.total`.

The sockets live in a thread of their own: the client load runs on the event loop, and a busy
loop must not delay the truth the pickers are compared with. Each pod's sequence numbers are
checked (from 0, without gaps): a batch the witness missed is counted, never silently absent.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEventDecoder

_GPU = frozenset({None, "GPU", "gpu"})  # a missing medium is the GPU cache (as the index takes it)
_POLL_MS = 100  # how often the thread looks at its stop flag when no event arrives
_DRAIN = 1_000  # messages read from one socket before the others get their turn


class WitnessReport(msgspec.Struct, frozen=True):
    """What the witness heard (a copy, taken under its lock)."""

    blocks: dict[str, int]  # pod -> blocks held, over its ranks
    missed: dict[str, int]  # pod -> batches whose sequence numbers never arrived
    restarts: dict[str, int]  # pod -> times its sequence went back (a restarted engine)
    undecodable: int  # messages or events the decoder skipped
    batches: int  # batches applied

    @property
    def total(self) -> int:
        """Blocks held over every pod and rank: what a pool's precise index should hold."""
        return sum(self.blocks.values())


class BlockWitness:
    """Subscribes to ``endpoints`` (pod name -> ``tcp://host:port`` of its PUB socket)."""

    def __init__(self, endpoints: dict[str, str]) -> None:
        self._endpoints = dict(endpoints)
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, int], set[int]] = {}
        self._next_seq: dict[str, int] = {}
        self._missed: Counter[str] = Counter()
        self._restarts: Counter[str] = Counter()
        self._batches = 0
        self._decoder = KVEventDecoder()
        self._connected: set[str] = set()
        self._all_connected = threading.Event()
        self._stop = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="block-witness", daemon=True)

    def start(self) -> None:
        """Connect to every pod (ZMQ retries until the pods have bound their sockets)."""
        self._thread.start()

    async def wait_connected(self, within: float) -> list[str]:
        """Wait until every SUB socket completed its handshake; the pods still unconnected
        (empty when all are)."""
        await asyncio.to_thread(self._all_connected.wait, within)
        if self._failure is not None:
            raise RuntimeError(f"the block witness failed: {self._failure!r}")
        with self._lock:
            return sorted(set(self._endpoints) - self._connected)

    def stop(self) -> None:
        """Close the sockets and end the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def report(self) -> WitnessReport:
        """The true block sets' sizes now, and what the witness may have missed."""
        with self._lock:
            blocks: Counter[str] = Counter()
            for (pod, _), hashes in self._ranks.items():
                blocks[pod] += len(hashes)
            return WitnessReport(dict(blocks), dict(self._missed), dict(self._restarts),
                                 sum(self._decoder.skipped.values()), self._batches)

    def _run(self) -> None:
        context = zmq.Context()
        sockets: dict[zmq.Socket[bytes], str] = {}
        monitors: dict[zmq.Socket[bytes], str] = {}
        try:
            for pod, endpoint in self._endpoints.items():
                sub: zmq.Socket[bytes] = context.socket(zmq.SUB)
                sub.setsockopt(zmq.RCVHWM, 0)  # never drop: the pods' PUB hwm bounds the queue
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                monitors[sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)] = pod
                sub.connect(endpoint)
                sockets[sub] = pod
            poller = zmq.Poller()
            for socket in (*sockets, *monitors):
                poller.register(socket, zmq.POLLIN)
            while not self._stop.is_set():
                for socket, _ in poller.poll(_POLL_MS):
                    if socket in monitors:
                        self._on_monitor(socket, monitors[socket])
                    else:
                        self._drain(socket, sockets[socket])
        except BaseException as exc:  # reported by wait_connected; the thread must not die mute
            self._failure = exc
            self._all_connected.set()
        finally:
            for socket in (*monitors, *sockets):
                socket.close(linger=0)
            context.term()

    def _on_monitor(self, monitor: zmq.Socket[bytes], pod: str) -> None:
        event = recv_monitor_message(monitor)
        if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            with self._lock:
                self._connected.add(pod)
                if len(self._connected) == len(self._endpoints):
                    self._all_connected.set()

    def _drain(self, socket: zmq.Socket[bytes], pod: str) -> None:
        for _ in range(_DRAIN):
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            with self._lock:  # report() reads the decoder's counts too
                batch = self._decoder.decode_message(frames)
                if batch is not None:
                    self._apply(pod, batch)

    def _apply(self, pod: str, batch: EventBatch) -> None:
        expected = self._next_seq.get(pod, 0)
        if batch.seq > expected:
            self._missed[pod] += batch.seq - expected
        elif batch.seq < expected:  # a restarted engine numbers from 0 again, its cache empty
            self._restarts[pod] += 1
            for key in [key for key in self._ranks if key[0] == pod]:
                del self._ranks[key]
        self._next_seq[pod] = batch.seq + 1
        self._batches += 1
        hashes = self._ranks.setdefault((pod, batch.dp_rank or 0), set())
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                hashes.clear()
            elif event.medium not in _GPU:
                continue
            elif isinstance(event, BlockStored):
                hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                hashes.difference_update(event.block_hashes)
