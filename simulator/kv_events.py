"""KV-cache events from a simulated pod, published as vLLM publishes them (ZMQ PUB + replay).

Configured like vLLM, with ``--kv-events-config`` JSON (``enable_kv_cache_events``,
``publisher``, ``endpoint``, ``replay_endpoint``, ``buffer_steps``, ``hwm``, ``topic``). Each
engine step that changed the prefix cache publishes one batch ``[topic, seq, payload]`` on the
PUB socket and keeps it in a ring of ``buffer_steps`` batches; the ROUTER socket answers a
request ``[identity, b"", start seq (8 bytes BE)]`` with every buffered batch from that sequence
on, ``[identity, b"", topic, seq, payload]``, then the end marker ``[identity, b"", b"", -1 (8
bytes), b""]``, as vLLM 0.26 and later do (:class:`Wire` ``replay_topic``; before 0.26 replies
had no topic frame: ``[identity, b"", seq, payload]`` and ``[identity, b"", -1, b""]``).

What goes on the wire is :class:`Wire`: by default what vLLM 0.33 sends (events as maps tagged
with ``"type"``, defaults left out, ``group_idx`` 0 and kind ``full_attention``; uint64 hashes;
the topic frame in replay replies), each older form behind a flag of ``lig sim``.

Differences from vLLM, on purpose: the simulator always binds (``*`` means the simulator's
``--host``, so tests stay on loopback), and it has no data-parallel ranks: pod ``i`` of one
process publishes on the endpoint's port + ``i`` (its replay socket likewise), each with rank 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import msgspec
import zmq
import zmq.asyncio

from shared.kv_events import END_SEQ, Encoding, Event, HashType, encode_payload

log = logging.getLogger("lig.sim.kv_events")


class KVEventsConfig(msgspec.Struct, frozen=True):
    """vLLM's ``--kv-events-config`` (fields the simulator does not use are accepted)."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        """True when events are published (``publisher`` ``null`` turns them off, as in vLLM)."""
        return self.enable_kv_cache_events and self.publisher != "null"


def parse_config(text: str) -> KVEventsConfig:
    """The config from its JSON text; ValueError names what is wrong."""
    try:
        config = msgspec.json.decode(text, type=KVEventsConfig)
    except msgspec.DecodeError as exc:
        raise ValueError(f"--kv-events-config: {exc}") from None
    if config.enabled and config.publisher != "zmq":
        raise ValueError(f"--kv-events-config: unknown publisher {config.publisher!r}")
    if config.buffer_steps < 1 or config.hwm < 0:
        raise ValueError("--kv-events-config: buffer_steps must be >= 1 and hwm >= 0")
    for endpoint in (config.endpoint, config.replay_endpoint):
        if endpoint is not None:
            bind_address(endpoint, "127.0.0.1", 0)
    return config


def bind_address(endpoint: str, host: str, offset: int) -> str:
    """``tcp://H:P`` to bind: ``*`` becomes ``host`` and the port moves up by ``offset``."""
    address, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit():
        raise ValueError(f"--kv-events-config: endpoint {endpoint!r} is not tcp://HOST:PORT")
    if not 0 < int(port) + offset <= 65535:
        raise ValueError(f"--kv-events-config: port {int(port) + offset} out of range")
    return f"tcp://{host if address == '*' else address}:{int(port) + offset}"


class Wire(msgspec.Struct, frozen=True):
    """The form of the events on the wire: vLLM 0.33's by default."""

    encoding: Encoding = "map"
    """``map`` (tagged with ``"type"``, vLLM since mid-2026) or ``array`` (positional, vLLM up
    to 0.23)."""
    hashes: HashType = "int"
    """``int`` (uint64, vLLM's default) or ``bytes`` (32-byte digests,
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``)."""
    replay_topic: bool = True
    """Replay replies carry the topic frame (vLLM 0.26 and later)."""


class EventPublisher:
    """One pod's PUB socket, replay ROUTER socket and ring of sent batches."""

    def __init__(self, config: KVEventsConfig, wire: Wire, host: str, offset: int) -> None:
        self.config = config
        self.wire = wire
        self.endpoint = bind_address(config.endpoint, host, offset)
        self.replay_endpoint = None if config.replay_endpoint is None \
            else bind_address(config.replay_endpoint, host, offset)
        self.seq = -1
        """Sequence number of the last batch published (the first is 0)."""
        self.drop_next = 0
        """Fault injection: this many next batches are buffered but not sent on PUB."""
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Bind the sockets (OSError/ZMQError if a port is taken) and serve replays."""
        pub = self._ctx.socket(zmq.PUB)
        pub.set_hwm(self.config.hwm)
        pub.linger = 0
        try:
            pub.bind(self.endpoint)
            if self.replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.linger = 0
                self._replay = replay
                replay.bind(self.replay_endpoint)
                self._task = asyncio.create_task(self._serve_replay(replay))
        except zmq.ZMQError as exc:
            pub.close()
            if self._replay is not None:
                self._replay.close()
            raise OSError(f"cannot bind KV-event sockets {self.endpoint}: {exc}") from None
        self._pub = pub
        wire = self.wire
        log.info("publishing KV-cache events on %s (replay %s%s, %s events, %s hashes)",
                 self.endpoint, self.replay_endpoint or "off",
                 "" if wire.replay_topic else " without topic frames", wire.encoding,
                 wire.hashes)

    def publish(self, events: list[Event]) -> None:
        """Send one batch (sequence ``seq + 1``) and keep it for replays."""
        self.seq += 1
        payload = encode_payload(time.time(), events, self.wire.encoding, 0, self.wire.hashes)
        self._buffer.append((self.seq, payload))
        if self.drop_next > 0:
            self.drop_next -= 1
            return
        if self._pub is not None:
            # PUB never blocks: at the high-water mark ZMQ drops, as vLLM's socket does.
            self._pub.send_multipart([self._topic, self.seq.to_bytes(8, "big"), payload],
                                     flags=zmq.NOBLOCK)

    async def _serve_replay(self, replay: zmq.asyncio.Socket) -> None:
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignoring a malformed replay request of %d frames", len(frames))
                continue
            try:
                await self._answer(replay, frames[0], int.from_bytes(frames[2], "big"))
            except zmq.ZMQError as exc:  # one failed answer must not end the replay service
                log.warning("replay from %d failed: %s", int.from_bytes(frames[2], "big"), exc)

    async def _answer(self, replay: zmq.asyncio.Socket, identity: bytes, start: int) -> None:
        """Every buffered batch from ``start`` on, then the end marker."""
        topic = [self._topic] if self.wire.replay_topic else []
        end = [b""] if self.wire.replay_topic else []
        # A snapshot: batches published while this replay is sent must not disturb it.
        for seq, payload in list(self._buffer):
            if seq >= start:
                await replay.send_multipart(
                    [identity, b"", *topic, seq.to_bytes(8, "big"), payload])
        await replay.send_multipart([identity, b"", *end, END_SEQ, b""])

    async def close(self) -> None:
        """Stop serving replays and close the sockets."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._ctx.term()
