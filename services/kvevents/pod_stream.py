"""One pod's KV-cache events: subscribe, keep the sequence whole through replays, republish.

Each pod has its own SUB socket and replay DEALER socket, in its own task, so a pod that floods,
stalls or sends garbage costs only its own stream. On start (and after an engine restart) the
stream asks the replay socket for everything from sequence 0 (or, resuming from the bridge's
recording, from the last batch published), so what the pod cached before we subscribed is known
too; when the replay cannot cover what was lost, it publishes a resync
marker (all cleared, state unknown) and carries on from what it has. Replays start at the last
batch applied, which tells the same engine from a restarted one, and every reconnection of the
SUB socket runs one: a restarted engine whose first batches were lost is still seen.

Each replay starts once the SUB connection's handshake is done, when the subscription is on its
way to the pod ahead of the replay request: a batch published after the replay then reaches the
SUB socket. (A replay started at ``connect()``, before the connection was up, missed what the
pod published in between until a later batch showed the gap.)
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from services.kvevents.sequencing import SequenceTracker, Verdict
from shared.kv_blocks import KVBlockChanges, marker
from shared.kv_events import END_SEQ, EventBatch, KVEventDecoder
from shared.waits import within

log = logging.getLogger("lig.kv_events.pod")


class PodEndpoints(msgspec.Struct, frozen=True):
    """Where one pod publishes its events, and where its changes go."""

    pool: str
    pod: str
    address: str  # ip:port the pod serves on
    events: str  # tcp://ip:port of its PUB socket
    replay: str | None  # tcp://ip:port of its replay ROUTER socket, None: no replay
    dp_rank: int = 0
    """The data-parallel rank behind these sockets (vLLM: rank r on the ports + r); each rank
    has its own sequence and its own blocks."""


class StreamSettings(msgspec.Struct, frozen=True):
    """Timeouts and bounds of one pod's stream."""

    replay_timeout_s: float = 2.0
    """Longest wait for the next replay frame."""
    max_replay_batches: int = 20_000
    """vLLM keeps 10,000 by default (``buffer_steps``)."""
    max_replay_bytes: int = 256 << 20
    """Payload bytes one replay may hold in memory; a larger one is given up (resync)."""


Publish = Callable[[KVBlockChanges], Awaitable[None]]


def replay_reply(frames: list[bytes]) -> tuple[bytes, bytes] | None:
    """``(seq, payload)`` of one reply of a vLLM replay socket, as a DEALER receives it; None
    if it is neither framing. vLLM 0.26 and later send ``["", topic, seq, payload]`` (the end
    marker ``["", "", END_SEQ, ""]``), earlier ones ``["", seq, payload]``."""
    if len(frames) == 4 and not frames[0] and len(frames[2]) == 8:
        return frames[2], frames[3]
    if len(frames) == 3 and not frames[0] and len(frames[1]) == 8:
        return frames[1], frames[2]
    return None


def describe_frames(frames: list[bytes]) -> str:
    """A short account of a multipart message for a log line: frame count, sizes, first
    bytes."""
    shown = ", ".join(f"{len(frame)}B {frame[:16]!r}" for frame in frames[:6])
    return f"{len(frames)} frames [{shown}{', ...' if len(frames) > 6 else ''}]"


class PodStream:
    """The event stream of one pod; ``counts`` says what happened to its batches."""

    def __init__(self, pod: PodEndpoints, ctx: zmq.asyncio.Context, decoder: KVEventDecoder,
                 publish: Publish, settings: StreamSettings | None = None,
                 on_count: Callable[[str, int], None] = lambda outcome, n: None) -> None:
        self.pod = pod
        self.settings = settings or StreamSettings()
        self.tracker = SequenceTracker()
        self.counts: Counter[str] = Counter()
        self._ctx = ctx
        self._decoder = decoder
        self._publish = publish
        self._dealer: zmq.asyncio.Socket | None = None
        self._on_count = on_count
        self._connections = 0
        """SUB connections made so far (every one after the first is a reconnection)."""
        self.following = False
        """The events connection is up and its replay done: every batch from here on is
        seen."""
        self._adopt_next = False
        """After a resync with nothing to continue from: the next batch starts the stream (no
        replay can bring what came before it)."""
        self._told_framing = False
        """An unreadable replay reply was logged (once per stream: a publisher that speaks
        another framing would fill the log)."""

    def resume(self, last: tuple[int, float]) -> None:
        """Go on after batch ``last`` (sequence, publish time), which an earlier bridge
        published, instead of from 0: call before :meth:`run`. Its first replay is asked from
        that batch; when the engine still holds it and what followed, nothing is cleared."""
        self.tracker.resume(*last)

    def _count(self, outcome: str, n: int = 1) -> None:
        self.counts[outcome] += n
        self._on_count(outcome, n)

    async def run(self) -> None:
        """Subscribe and republish until cancelled."""
        sub = self._ctx.socket(zmq.SUB)
        sub.linger = 0
        sub.subscribe(b"")
        # Connection events start the first replay, and show a restarted engine even when its
        # first batches are lost before the SUB connection is back (or it publishes nothing
        # for a while).
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                         | zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        sub.connect(self.pod.events)
        try:
            while True:
                await poller.poll()
                # Connection events first: a reconnection is reported before any batch of
                # the new connection can be read, so it is checked before such a batch counts.
                await self._watch_connection(monitor)
                try:
                    frames = await sub.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    continue
                batch = self._decoder.decode_message(frames)
                if batch is None:
                    self._count("malformed")
                    self._skip_malformed(frames)
                    continue
                await self._handle(batch)
        finally:
            self.following = False
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            self._close_dealer()

    async def _watch_connection(self, monitor: zmq.asyncio.Socket) -> None:
        """Handle the SUB socket's pending connection events: the first connection replays
        from 0; one after it may be a restarted engine, which a replay from the last batch
        applied tells."""
        while True:
            try:
                frames = await monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self.following = False
                log.info("%s/%s rank %d: events connection lost", self.pod.pool,
                         self.pod.pod, self.pod.dp_rank)
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connections += 1
                if self._connections > 1:
                    log.info("%s/%s rank %d: events connection back: checking the engine",
                             self.pod.pool, self.pod.pod, self.pod.dp_rank)
                await self._recover(None)
                self.following = True

    def _skip_malformed(self, frames: list[bytes]) -> None:
        """A batch whose payload does not decode is lost, but its sequence number counts: a
        replay would only bring the same bytes again."""
        if len(frames) == 3 and len(frames[1]) == 8:
            seq = int.from_bytes(frames[1], "big")
            if seq == self.tracker.expected:
                self.tracker.applied(seq)

    async def _handle(self, batch: EventBatch) -> None:
        if self._adopt_next:
            self._adopt_next = False
            self.tracker.skip_to(batch.seq)
        verdict = self.tracker.classify(batch.seq, batch.ts)
        self._count(verdict.value)
        if verdict is Verdict.APPLY:
            await self._apply(batch)
        elif verdict is Verdict.GAP:
            log.info("%s/%s rank %d: batches %d..%d missing, replaying", self.pod.pool,
                     self.pod.pod, self.pod.dp_rank, self.tracker.expected, batch.seq - 1)
            await self._recover(batch)
        elif verdict is Verdict.RESET:
            await self._restarted(batch)

    async def _apply(self, batch: EventBatch) -> None:
        self.tracker.applied(batch.seq, batch.ts)
        if batch.events:
            pod = self.pod
            await self._publish(KVBlockChanges(
                pod.pool, pod.pod, pod.address, batch.seq, batch.ts, list(batch.events),
                pod.dp_rank))

    async def _marker(self, resync: bool) -> None:
        """Tell subscribers this rank's cache is empty (``resync``: and partly unknown)."""
        pod = self.pod
        await self._publish(marker(pod.pool, pod.pod, pod.address, pod.dp_rank, time.time(),
                                   resync=resync))

    async def _recover(self, current: EventBatch | None) -> None:
        """Replay from the last batch applied; then apply ``current`` (the batch that showed
        the gap) if the replay did not cover it. A replay that shows another engine than the
        one that sent the last batch applied starts it over (clear marker, replay from 0); lost
        batches that cannot be replayed publish a resync marker."""
        tracker = self.tracker
        start = tracker.expected
        # From the last batch applied, not the next one: that batch proves the same engine.
        ask = start if tracker.last is None else tracker.last[0]
        tracker.replaying()
        batches = await self._replay(ask)
        if batches is not None:
            first = (batches[0].seq, batches[0].ts) if batches else None
            same = tracker.same_engine(first)
            if same is False:
                self._count("reset")
                await self._restarted(current)
                return
            # same is None: its buffer no longer reaches our last batch, so we cannot tell.
            batches = None if same is None else [b for b in batches if b.seq >= start]
        if batches is None or (batches and batches[0].seq != start) \
                or (not batches and current is not None):
            self._count("resync")
            log.warning("%s/%s: batches from %d cannot be replayed: resync", self.pod.pool,
                        self.pod.pod, start)
            await self._marker(resync=True)
            if batches:
                tracker.skip_to(batches[0].seq)
            elif current is not None:
                tracker.skip_to(current.seq)
            else:
                self._adopt_next = True
        else:
            self._count("replayed", len(batches))
        for batch in batches or ():
            if batch.seq > tracker.expected:  # a batch in between did not decode: lost
                tracker.skip_to(batch.seq)
            if batch.seq == tracker.expected:
                await self._apply(batch)
        if current is not None and current.seq == tracker.expected:
            await self._apply(current)

    async def _restarted(self, current: EventBatch | None) -> None:
        """The engine restarted (its sequence counts from 0 again): clear the rank's blocks
        and follow the new stream from its start."""
        log.info("%s/%s rank %d: engine restarted: following its new stream from 0",
                 self.pod.pool, self.pod.pod, self.pod.dp_rank)
        await self._marker(resync=False)
        self.tracker.restart()
        if current is not None and current.seq == 0:
            await self._apply(current)  # the whole new stream is here: nothing to replay
        else:
            await self._recover(current)

    async def _replay(self, start: int) -> list[EventBatch] | None:
        """The pod's buffered batches from ``start`` on, in order; None if it has no replay
        socket or does not answer in time."""
        if self.pod.replay is None:
            return None
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.linger = 0
            self._dealer.connect(self.pod.replay)
        dealer = self._dealer
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        batches: list[EventBatch] = []
        size = 0
        try:
            for _ in range(self.settings.max_replay_batches + 1):
                frames = await within(dealer.recv_multipart(), self.settings.replay_timeout_s)
                reply = replay_reply(frames)
                if reply is None:
                    self._count("replay_malformed")
                    if not self._told_framing:
                        self._told_framing = True
                        log.warning("%s/%s rank %d: unreadable replay reply: %s", self.pod.pool,
                                    self.pod.pod, self.pod.dp_rank, describe_frames(frames))
                    continue
                seq, payload = reply
                if seq == END_SEQ:
                    return batches
                size += len(payload)
                if size > self.settings.max_replay_bytes:
                    log.warning("%s/%s: replay from %d exceeds %d bytes: giving up",
                                self.pod.pool, self.pod.pod, start,
                                self.settings.max_replay_bytes)
                    break
                batch = self._decoder.decode_payload(int.from_bytes(seq, "big"), payload)
                if batch is not None:
                    batches.append(batch)
        except TimeoutError:
            log.warning("%s/%s: replay from %d timed out after %d batches", self.pod.pool,
                        self.pod.pod, start, len(batches))
        # A replay that did not finish may still send: a fresh socket keeps it out of the next.
        self._close_dealer()
        return None

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None
