"""An HTTP/2 client driven by hand against :class:`Http2Connection` in-process: a fake
transport (no network), a handler that echoes, and frame parsing; and :class:`RawClient`, one
that follows the server's windows over loopback. Used by the HTTP/2 server's unit tests, its
fuzz suite and its attack benchmark."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import hpack

from protocols.http2 import (
    ACK,
    DATA,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    PREFACE,
    SETTINGS,
    WINDOW_UPDATE,
    Http2Connection,
    frame,
)
from protocols.http2_limits import MIB, BufferBudget, Http2Limits

PATH = b"/test.Echo/Chat"


def decode_fields(decoder: hpack.Decoder, block: bytes) -> dict[str, str]:
    """The header fields of an HPACK ``block``, as text."""
    # raw=True: hpack annotates decode() as bytes pairs whatever ``raw`` says
    return {name.decode(): value.decode() for name, value in decoder.decode(block, raw=True)}


class FakeTransport(asyncio.Transport):
    """Collects what the connection writes; like asyncio's transports, it tells its protocol
    to pause writing once more than the high-water mark is unread (``written``)."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False
        self.aborted = False
        self.reading = True
        self.protocol: asyncio.Protocol | None = None
        self.high_water = 1 << 62
        self.low_water = 0
        self.writing_paused = False

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        # asyncio's defaults for an omitted limit: 64 KiB high, a quarter of high low
        self.high_water = high if high is not None else 64 * 1024
        self.low_water = low if low is not None else self.high_water // 4

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data
        if len(self.written) > self.high_water and not self.writing_paused \
                and self.protocol is not None:
            self.writing_paused = True
            self.protocol.pause_writing()

    def drained(self) -> None:
        """The peer read everything: below the low-water mark again."""
        if self.writing_paused and self.protocol is not None:
            self.writing_paused = False
            self.protocol.resume_writing()

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True


class Echo:
    """A handler that answers each message with ``echo:`` + message, and records its life."""

    def __init__(self, log: list[str], end_after: int | None = None) -> None:
        self.log = log
        self.end_after = end_after
        self.count = 0

    def on_message(self, message: bytes) -> tuple[Sequence[bytes], bool]:
        self.count += 1
        self.log.append(f"message {message.decode()}")
        return [b"echo:" + message], self.count == self.end_after

    def on_close(self) -> None:
        self.log.append("closed")


def grpc_message(payload: bytes, compressed: bool = False) -> bytes:
    return bytes((int(compressed),)) + len(payload).to_bytes(4, "big") + payload


def parse(data: bytes) -> list[tuple[int, int, int, bytes]]:
    frames = []
    position = 0
    while position < len(data):
        length = int.from_bytes(data[position: position + 3], "big")
        kind, flags = data[position + 3], data[position + 4]
        stream_id = int.from_bytes(data[position + 5: position + 9], "big")
        frames.append((kind, flags, stream_id, bytes(data[position + 9: position + 9 + length])))
        position += 9 + length
    return frames


class Peer:
    """The client side of one connection, driven by hand."""

    def __init__(self, end_after: int | None = None, max_message: int = 1000,
                 limits: Http2Limits | None = None,
                 handler: Callable[[list[str]], Echo] | None = None,
                 budget: BufferBudget | None = None,
                 clock: Callable[[], float] = lambda: 0.0) -> None:
        """``budget``: a server-wide budget this connection alone draws on (it reclaims from
        its own partial messages). ``clock`` refills the connection's control-frame and reset
        budgets: frozen by default, so a flood is judged on the frames alone (on the real clock
        a loaded machine refilled the budget while it was still reading the flood)."""
        self.log: list[str] = []
        self.lost = False
        make = handler or (lambda log: Echo(log, end_after))
        self.connection = Http2Connection({PATH: lambda: make(self.log)}, max_message,
                                          on_lost=lambda _: setattr(self, "lost", True),
                                          limits=limits, budget=budget, reclaim=self._reclaim,
                                          clock=clock)
        self.transport = FakeTransport()
        self.transport.protocol = self.connection
        self.connection.connection_made(self.transport)
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.server_greeting = self.read()

    def _reclaim(self, connection: Http2Connection) -> bool:
        if not self.connection.largest_partial():
            return False
        self.connection.end_largest_partial()
        return True

    def send(self, *frames: bytes) -> None:
        self.connection.data_received(b"".join(frames))

    def start(self, settings: bytes = b"") -> None:
        self.send(PREFACE, frame(SETTINGS, 0, 0, settings))
        assert (SETTINGS, ACK, 0, b"") in self.read()

    def read(self) -> list[tuple[int, int, int, bytes]]:
        """The frames the server wrote since the last read (parsed)."""
        frames = parse(bytes(self.transport.written))
        self.transport.written.clear()
        self.transport.drained()  # read, so the server may go on reading too
        return frames

    def headers(self, stream_id: int, path: bytes = PATH, flags: int = END_HEADERS) -> bytes:
        block = self.encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", path),
                                     (":authority", "picker"), ("te", "trailers"),
                                     ("content-type", "application/grpc")])
        return frame(HEADERS, flags, stream_id, block)

    def header_fields(self, block: bytes) -> dict[str, str]:
        return decode_fields(self.decoder, block)


class RawClient:
    """One HTTP/2 client connection on loopback that sends only what its windows allow."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.window = DEFAULT_WINDOW  # connection send window
        self.stream_windows: dict[int, int] = {}
        self.frames: list[tuple[int, int, int, bytes]] = []
        self._unparsed = bytearray()
        self.eof = False

    @classmethod
    async def connect(cls, port: int) -> RawClient:
        client = cls(*await asyncio.open_connection("127.0.0.1", port))
        # Like Envoy: large receive windows, so that answers never wait for them.
        client.writer.write(PREFACE + frame(SETTINGS, 0, 0, INITIAL_WINDOW_SIZE.to_bytes(2, "big")
                                            + (16 * MIB).to_bytes(4, "big"))
                            + frame(WINDOW_UPDATE, 0, 0, (16 * MIB).to_bytes(4, "big")))
        await client.writer.drain()
        await client.pump(0.05)
        return client

    async def pump(self, quiet: float) -> None:
        """Read what the server sent until it has been quiet for ``quiet`` seconds."""
        while not self.eof:
            try:
                data = await asyncio.wait_for(self.reader.read(1 << 20), quiet)
            except TimeoutError:
                return
            except ConnectionError:  # the server reset it (an attacker it cut off): the end
                self.eof = True
                return
            if not data:
                self.eof = True
                return
            self._unparsed += data
            usable = 0
            while len(self._unparsed) - usable >= 9:
                length = int.from_bytes(self._unparsed[usable: usable + 3], "big")
                if len(self._unparsed) - usable < 9 + length:
                    break
                usable += 9 + length
            for kind, flags, stream_id, payload in parse(bytes(self._unparsed[:usable])):
                self.frames.append((kind, flags, stream_id, payload))
                if kind == WINDOW_UPDATE:
                    increment = int.from_bytes(payload, "big")
                    if stream_id == 0:
                        self.window += increment
                    elif stream_id in self.stream_windows:
                        self.stream_windows[stream_id] += increment
            del self._unparsed[:usable]

    async def pump_until(self, done: Callable[[], bool], rounds: int = 200) -> None:
        """Read until ``done()`` (or the end), at most ``rounds`` quiet spells of 50 ms: bounded
        by a count, generous, since a loaded machine may answer after any short quiet."""
        for _ in range(rounds):
            if done() or self.eof:
                return
            await self.pump(0.05)

    def open(self, stream_id: int) -> None:
        block = self.encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", PATH),
                                     (":authority", "picker"), ("te", "trailers"),
                                     ("content-type", "application/grpc")])
        self.writer.write(frame(HEADERS, END_HEADERS, stream_id, block))
        self.stream_windows[stream_id] = 1 * MIB  # the server's advertised initial window

    def send(self, stream_id: int, data: bytes, end: bool = False) -> int:
        """Send as much of ``data`` as the windows allow; returns how much went."""
        allowed = min(len(data), self.window, self.stream_windows[stream_id])
        sent = 0
        while sent < allowed:
            chunk = min(allowed - sent, 1 * MIB)
            last = end and sent + chunk == len(data)
            self.writer.write(frame(DATA, END_STREAM if last else 0, stream_id,
                                    data[sent: sent + chunk]))
            sent += chunk
        self.window -= sent
        self.stream_windows[stream_id] -= sent
        return sent

    def status(self, stream_id: int) -> str | None:
        """The grpc-status of a call that ended (None: not ended)."""
        for kind, flags, sid, payload in self.frames:
            if kind == HEADERS and sid == stream_id and flags & END_STREAM:
                return decode_fields(self.decoder, payload).get("grpc-status")
        return None

    def answers(self, stream_id: int) -> bytes:
        return b"".join(payload for kind, _, sid, payload in self.frames
                        if kind == DATA and sid == stream_id)

    def close(self) -> None:
        self.writer.close()


async def trickle(clients: Sequence[RawClient], size: int, rounds: int = 200,
                  after_round: Callable[[], None] = lambda: None,
                  seconds: float | None = None) -> list[int]:
    """Each client opens stream 1 with a message announcing ``size`` bytes and sends all of it
    but the last byte, 1 MiB at a time, as fast as the server's windows allow, never the end:
    until no client has sent more for 5 rounds, the server ended their calls, or ``rounds``
    ran out (a count, not a time: a loaded machine slows the rounds, and an attacker stopped
    by the clock rather than by the server would prove nothing; ``seconds`` caps a benchmark's
    run, tests leave it out); ``after_round`` is called after each round. Returns the bytes
    each client sent."""
    total = 5 + size - 1
    sent = [0] * len(clients)
    for client in clients:
        client.open(1)
    deadline = None if seconds is None else time.monotonic() + seconds
    still = 0  # rounds in a row without progress (a window update may be in flight)
    for _ in range(rounds):
        progress = 0
        for index, client in enumerate(clients):
            await client.pump(0.005)
            if client.eof or client.status(1) is not None or sent[index] == total:
                continue
            piece = min(MIB, total - sent[index])
            data = (b"\x00" + size.to_bytes(4, "big") + b"p" * (piece - 5) if not sent[index]
                    else b"p" * piece)
            went = client.send(1, data)
            sent[index] += went
            progress += went
            try:
                await client.writer.drain()
            except ConnectionError:  # cut off by the server between two reads
                client.eof = True
        await asyncio.sleep(0.01)
        after_round()
        still = 0 if progress else still + 1
        if still == 5 or (deadline is not None and time.monotonic() > deadline):
            break
    return sent
