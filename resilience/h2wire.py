"""HTTP/2 as an attacker writes it: raw frames (RFC 9113) and header blocks (RFC 7541) built by
hand, so that any field can be wrong on purpose, and a PING probe that times the server's answers.

Nothing here validates anything; the server under test must.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hpack.hpack import encode_integer

from shared.service import cancel_and_wait
from shared.waits import within

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE = 1, 2, 3, 4
CANCEL = 0x8
PROCESS_PATH = b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame: 9-byte header, then ``payload``."""
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags))
            + stream_id.to_bytes(4, "big") + payload)


def settings(**values: int) -> bytes:
    """A SETTINGS frame; keys are the names above in lower case (``initial_window_size=0``)."""
    ids = {"header_table_size": HEADER_TABLE_SIZE, "enable_push": ENABLE_PUSH,
           "max_concurrent_streams": MAX_CONCURRENT_STREAMS,
           "initial_window_size": INITIAL_WINDOW_SIZE}
    payload = b"".join(ids[key].to_bytes(2, "big") + value.to_bytes(4, "big")
                       for key, value in values.items())
    return frame(SETTINGS, 0, 0, payload)


def hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer with an N-bit prefix; ``first`` holds the bits above the prefix."""
    encoded = encode_integer(value, prefix_bits)
    encoded[0] |= first
    return bytes(encoded)


def literal(name: bytes, value: bytes, indexed: bool = False) -> bytes:
    """A literal header field with a literal name, no Huffman; ``indexed`` adds it to the
    decoder's dynamic table (incremental indexing) instead of leaving it out."""
    first = b"\x40" if indexed else b"\x00"
    return first + hpack_int(len(name), 7) + name + hpack_int(len(value), 7) + value


def request_block(path: bytes = PROCESS_PATH) -> bytes:
    """The header block of a gRPC call to ``path``, with no dynamic-table state."""
    return (b"\x83\x86"  # :method POST, :scheme http (static table)
            + literal(b":path", path) + literal(b":authority", b"picker")
            + literal(b"content-type", b"application/grpc") + literal(b"te", b"trailers"))


def grpc_frame(message: bytes) -> bytes:
    """A gRPC length-prefixed message (uncompressed)."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


# The first message Envoy sends on a Process stream; the picker answers it at once.
REQUEST_HEADERS_MESSAGE = grpc_frame(pb.ProcessingRequest(
    request_headers=pb.HttpHeaders(end_of_stream=False)).SerializeToString())


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, int, int, bytes]:
    """The next frame: (type, flags, stream id, payload); IncompleteReadError at EOF."""
    head = await reader.readexactly(9)
    payload = await reader.readexactly(int.from_bytes(head[:3], "big"))
    return head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, payload


async def open_connection(host: str, port: int, connect_within: float = 5.0,
                          ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP connection with a large read limit (frames are read by length, not by line)."""
    return await within(asyncio.open_connection(host, port, limit=1 << 24), connect_within)


def close(writer: asyncio.StreamWriter) -> None:
    """Drop the connection at once: a peer under attack may never read what is still queued,
    and no await here means a cancellation cannot be lost in it."""
    writer.transport.abort()


async def ping_once(host: str, port: int, within: float) -> float | None:
    """Seconds until one PING on a new connection is answered; None if not within ``within``."""
    started = time.perf_counter()
    try:
        async with asyncio.timeout(within):
            reader, writer = await open_connection(host, port, within)
            try:
                writer.write(PREFACE + settings() + frame(PING, 0, 0, b"settled?"))
                await PingProbe.await_ack(reader, writer, b"settled?")
            finally:
                close(writer)
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        return None
    return time.perf_counter() - started


class PingProbe:
    """A well-behaved client connection that sends a PING every ``interval`` seconds and times
    each answer: how long the server's event loop is blocked, as a client sees it.

    A PING unanswered after ``timeout`` seconds counts as ``timeout`` and the probe reconnects;
    a refused or lost connection is counted too.
    """

    def __init__(self, host: str, port: int, interval: float = 0.1, timeout: float = 5.0) -> None:
        self.host = host
        self.port = port
        self.interval = interval
        self.timeout = timeout
        self.rtts: list[float] = []
        self.failures = 0
        self._waiting_since: float | None = None
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start probing in the background."""
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop probing; a PING still unanswered counts with its wait so far (a lower bound)."""
        self._stopping = True  # ends the loop even if a cancellation is swallowed on the way
        if self._task is not None:
            await cancel_and_wait(self._task, grace=self.timeout)
        if self._waiting_since is not None:
            self.rtts.append(time.perf_counter() - self._waiting_since)
            self._waiting_since = None

    @property
    def worst(self) -> float:
        """The longest wait for an answer, in seconds (``timeout`` for a lost PING)."""
        return max(self.rtts, default=0.0)

    @property
    def median(self) -> float:
        return statistics.median(self.rtts) if self.rtts else 0.0

    async def _run(self) -> None:
        counter = 0
        while not self._stopping:
            try:
                reader, writer = await open_connection(self.host, self.port, self.timeout)
            except (OSError, TimeoutError):
                self.failures += 1
                await asyncio.sleep(self.interval)
                continue
            try:
                writer.write(PREFACE + settings())
                while not self._stopping:
                    counter += 1
                    payload = counter.to_bytes(8, "big")
                    self._waiting_since = sent = time.perf_counter()
                    writer.write(frame(PING, 0, 0, payload))
                    try:
                        async with asyncio.timeout(self.timeout):
                            await self.await_ack(reader, writer, payload)
                    except TimeoutError:
                        self.rtts.append(self.timeout)
                        self.failures += 1
                        break
                    finally:
                        self._waiting_since = None
                    self.rtts.append(time.perf_counter() - sent)
                    await asyncio.sleep(self.interval)
            except (OSError, asyncio.IncompleteReadError):
                self.failures += 1
            finally:
                close(writer)

    @staticmethod
    async def await_ack(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        payload: bytes) -> None:
        """Read frames (acknowledging SETTINGS) until the PING ACK carrying ``payload``."""
        while True:
            kind, flags, _, body = await read_frame(reader)
            if kind == SETTINGS and not flags & ACK:
                writer.write(frame(SETTINGS, ACK, 0))
            elif kind == PING and flags & ACK and body == payload:
                return
