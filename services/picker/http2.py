"""A small gRPC server over HTTP/2 for bidirectional-streaming methods (Envoy's ext_proc).

Why it exists: grpc.aio hands every completion (stream start, each read, each write, the status,
the close: eight per HTTP request) from gRPC's C-core threads to the event loop through a
socket, and that hand-off is most of the ~360 µs of CPU a logic-free ext_proc stream costs under
grpc.aio on a small machine. Here HTTP/2 runs in the event loop's own thread: one read carries
frames of many streams, and the answers to all of them leave in one write.

Scope is what Envoy's gRPC client uses, implemented to RFC 9113: SETTINGS, PING, GOAWAY (also a
two-step graceful drain), RST_STREAM, WINDOW_UPDATE and flow control both ways, CONTINUATION,
padding and priority fields. HPACK decoding is the `hpack` package's; the peer is asked for no
dynamic table, so that the identical header blocks Envoy sends for every stream decode once.
TLS is the event loop's (``Http2Server.start(tls=...)``). Not supported: compressed messages
(refused with UNIMPLEMENTED; Envoy does not compress), server push (never used by a server of
this kind).

:class:`Http2Connection` is the protocol for one client connection and is testable with a fake
transport; :class:`Http2Server` listens and drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import hpack

log = logging.getLogger("lig.picker.http2")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Frame types (RFC 9113 section 6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
# Flags.
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# Error codes.
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM, \
    COMPRESSION_ERROR = 0x0, 0x1, 0x3, 0x6, 0x7, 0x9
# Settings.
HEADER_TABLE_SIZE, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 0x1, 0x4, 0x5
# gRPC status codes.
GRPC_OK, GRPC_RESOURCE_EXHAUSTED, GRPC_UNIMPLEMENTED, GRPC_INTERNAL = 0, 8, 12, 13

MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME_SIZE = 16_384
RECEIVE_FRAME_SIZE = 1 << 20  # what we accept (advertised); fewer frames for large bodies
WINDOW_REFILL = 1 << 30  # received bytes after which the windows are topped up again
MAX_HEADER_BLOCK = 256 * 1024  # bytes of one header block over CONTINUATION frames
_DRAIN_PING = b"lig-stop"


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame."""
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags))
            + stream_id.to_bytes(4, "big") + payload)


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman coding."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


def _hpack_int(value: int, prefix_bits: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((value,))
    out = [limit]
    value -= limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


# ":status: 200" is static table entry 8; content-type (entry 31) as a literal without indexing.
RESPONSE_HEADERS = b"\x88" + b"\x0f\x10" + _hpack_int(16, 7) + b"application/grpc"


def trailers(status: int, message: str = "") -> bytes:
    """The HPACK block of gRPC trailers (``grpc-status``, and ``grpc-message`` when given)."""
    block = _literal(b"grpc-status", str(status).encode())
    if message:
        # grpc-message is percent-encoded outside printable ASCII (gRPC over HTTP/2 spec).
        encoded = "".join(c if " " <= c <= "~" and c != "%" else
                          "".join(f"%{b:02X}" for b in c.encode()) for c in message)
        block += _literal(b"grpc-message", encoded.encode())
    return block


TRAILERS_OK = trailers(GRPC_OK)


class StreamHandler(Protocol):
    """One call of a streaming method: messages in, serialized answers out."""

    def on_message(self, message: bytes) -> tuple[Sequence[bytes], bool]:
        """Answers to one request message, and True when the call should end after them."""
        ...

    def on_close(self) -> None:
        """The call ended (finished, reset by the client, or its connection was lost)."""
        ...


Handlers = Mapping[bytes, Callable[[], StreamHandler]]  # method path -> a new call's handler


class ProtocolFault(Exception):
    """A connection error: answered with GOAWAY and the connection closed."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class _Stream:
    __slots__ = ("finished", "handler", "headers_sent", "id", "inbox", "pending",
                 "received", "remote_closed", "send_window", "trailers")

    def __init__(self, stream_id: int, handler: StreamHandler, send_window: int) -> None:
        self.id = stream_id
        self.handler = handler
        self.send_window = send_window
        self.inbox = bytearray()
        self.pending = bytearray()  # answer bytes waiting for flow-control window
        self.trailers: bytes | None = None  # trailers waiting behind `pending`
        self.headers_sent = False
        self.finished = False  # the handler was closed; trailers sent or queued
        self.remote_closed = False
        self.received = 0  # flow-controlled bytes since this stream's window was last topped up


class Http2Connection(asyncio.Protocol):
    """The server side of one HTTP/2 connection carrying gRPC calls."""

    def __init__(self, handlers: Handlers, max_message: int,
                 on_lost: Callable[[Http2Connection], None] = lambda connection: None) -> None:
        self._handlers = handlers
        self._max_message = max_message
        self._on_lost = on_lost
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._out: list[bytes] = []
        self._preface_seen = False
        self._streams: dict[int, _Stream] = {}
        self._last_stream = 0
        self._header_block: tuple[int, int, bytearray] | None = None  # awaiting CONTINUATION
        self._decoder = hpack.Decoder()  # its table limit drops to 0 once our SETTINGS are acked
        self._paths: dict[bytes, bytes] = {}  # header block -> :path, for table-free blocks
        self._send_window = DEFAULT_WINDOW
        self._initial_send_window = DEFAULT_WINDOW
        self._max_frame_out = DEFAULT_FRAME_SIZE
        self._received = 0
        self._blocked: list[_Stream] = []
        self._draining = False  # no new streams: our final GOAWAY went out, or the client sent one
        self._closing = False

    # --- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        settings = (HEADER_TABLE_SIZE.to_bytes(2, "big") + (0).to_bytes(4, "big")
                    + INITIAL_WINDOW_SIZE.to_bytes(2, "big") + MAX_WINDOW.to_bytes(4, "big")
                    + MAX_FRAME_SIZE.to_bytes(2, "big") + RECEIVE_FRAME_SIZE.to_bytes(4, "big"))
        self._out.append(frame(SETTINGS, 0, 0, settings))
        self._out.append(frame(WINDOW_UPDATE, 0, 0,
                               (MAX_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big")))
        self._write()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        try:
            self._process()
        except ProtocolFault as exc:
            log.warning("HTTP/2 connection error (%s), closing: %s", exc.code, exc)
            self._out.append(frame(GOAWAY, 0, 0, self._last_stream.to_bytes(4, "big")
                                   + exc.code.to_bytes(4, "big")))
            self._write()
            self._close()
            return
        self._write()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._closing = True
        for stream in list(self._streams.values()):
            self._drop(stream)
        self._on_lost(self)

    # --- draining ----------------------------------------------------------------------------

    @property
    def open_streams(self) -> int:
        """Calls not yet ended on this connection."""
        return len(self._streams)

    def drain(self) -> None:
        """Start a graceful close: GOAWAY now, a final GOAWAY once the client has seen it."""
        if self._transport is None or self._closing:
            return
        # Two steps (RFC 9113 6.8): streams the client opens before it sees the first GOAWAY
        # are still served; the PING's answer tells when it has seen it.
        self._out.append(frame(GOAWAY, 0, 0, MAX_WINDOW.to_bytes(4, "big")
                               + NO_ERROR.to_bytes(4, "big")))
        self._out.append(frame(PING, 0, 0, _DRAIN_PING))
        self._write()

    def abort(self) -> None:
        """Close now (open calls are dropped)."""
        if self._transport is not None:
            self._transport.abort()

    # --- frames in ---------------------------------------------------------------------------

    def _process(self) -> None:
        buffer = self._buffer
        position = 0
        if not self._preface_seen:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(bytes(buffer)):
                    raise ProtocolFault(PROTOCOL_ERROR, "not an HTTP/2 client preface")
                return
            if buffer[: len(PREFACE)] != PREFACE:
                raise ProtocolFault(PROTOCOL_ERROR, "not an HTTP/2 client preface")
            position = len(PREFACE)
            self._preface_seen = True
        end_of_data = len(buffer)
        while end_of_data - position >= 9 and not self._closing:
            length = int.from_bytes(buffer[position: position + 3], "big")
            if length > RECEIVE_FRAME_SIZE:
                raise ProtocolFault(FRAME_SIZE_ERROR, f"frame of {length} bytes")
            end = position + 9 + length
            if end > end_of_data:
                break
            kind, flags = buffer[position + 3], buffer[position + 4]
            stream_id = int.from_bytes(buffer[position + 5: position + 9], "big") & MAX_WINDOW
            payload = bytes(buffer[position + 9: end])
            position = end
            self._frame(kind, flags, stream_id, payload)
        del buffer[:position]

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._header_block is not None and kind != CONTINUATION:
            raise ProtocolFault(PROTOCOL_ERROR, "header block interrupted")
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._continuation(flags, stream_id, payload)
        elif kind == RST_STREAM:
            stream = self._streams.get(stream_id)
            if stream is not None:
                self._drop(stream)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == PING:
            self._ping(flags, stream_id, payload)
        elif kind == GOAWAY:
            self._draining = True  # the client opens no more streams here
            self._close_if_idle()
        elif kind == PUSH_PROMISE:
            raise ProtocolFault(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # PRIORITY and unknown frame types are ignored, as RFC 9113 requires.

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ProtocolFault(PROTOCOL_ERROR, "DATA on stream 0")
        self._received += len(payload)
        if self._received >= WINDOW_REFILL:
            self._out.append(frame(WINDOW_UPDATE, 0, 0, self._received.to_bytes(4, "big")))
            self._received = 0
        stream = self._streams.get(stream_id)
        if stream is None:
            if stream_id > self._last_stream:
                raise ProtocolFault(PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            return  # a stream that ended here already: its data is discarded
        stream.received += len(payload)
        if stream.received >= WINDOW_REFILL:
            self._out.append(frame(WINDOW_UPDATE, 0, stream_id,
                                   stream.received.to_bytes(4, "big")))
            stream.received = 0
        if flags & PADDED:
            payload = _unpad(payload)
        if not stream.finished:
            stream.inbox += payload
            self._messages(stream)
        if flags & END_STREAM:
            self._remote_end(stream)

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0 or stream_id % 2 == 0:
            raise ProtocolFault(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
        if flags & PADDED:
            payload = _unpad(payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if flags & END_HEADERS:
            self._header_block_done(stream_id, flags, payload)
        else:
            self._header_block = (stream_id, flags, bytearray(payload))

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        pending = self._header_block
        if pending is None or pending[0] != stream_id:
            raise ProtocolFault(PROTOCOL_ERROR, "unexpected CONTINUATION")
        pending[2].extend(payload)
        if len(pending[2]) > MAX_HEADER_BLOCK:
            raise ProtocolFault(PROTOCOL_ERROR, "header block too large")
        if flags & END_HEADERS:
            self._header_block = None
            self._header_block_done(stream_id, pending[1], bytes(pending[2]))

    def _header_block_done(self, stream_id: int, flags: int, block: bytes) -> None:
        path = self._path(block)  # decoded even when unused: HPACK state must follow
        stream = self._streams.get(stream_id)
        if stream is not None:  # trailers from the client end its side of the call
            if not flags & END_STREAM:
                raise ProtocolFault(PROTOCOL_ERROR, "second HEADERS without END_STREAM")
            self._remote_end(stream)
            return
        if stream_id <= self._last_stream:
            raise ProtocolFault(PROTOCOL_ERROR, f"HEADERS on closed stream {stream_id}")
        self._last_stream = stream_id
        if self._draining:
            self._out.append(frame(RST_STREAM, 0, stream_id, REFUSED_STREAM.to_bytes(4, "big")))
            return
        factory = self._handlers.get(path)
        if factory is None:
            block = RESPONSE_HEADERS + trailers(GRPC_UNIMPLEMENTED,
                                                f"unknown method {path.decode(errors='replace')}")
            self._out.append(frame(HEADERS, END_HEADERS | END_STREAM, stream_id, block))
            if not flags & END_STREAM:
                self._out.append(frame(RST_STREAM, 0, stream_id, NO_ERROR.to_bytes(4, "big")))
            return
        stream = _Stream(stream_id, factory(), self._initial_send_window)
        self._streams[stream_id] = stream
        if flags & END_STREAM:
            self._remote_end(stream)

    def _path(self, block: bytes) -> bytes:
        known = self._paths.get(block)
        if known is not None:
            return known
        table = self._decoder.header_table
        table_free = not table.dynamic_entries
        try:
            headers = self._decoder.decode(block, raw=True)
        except hpack.HPACKError as exc:
            raise ProtocolFault(COMPRESSION_ERROR, f"bad header block: {exc}") from None
        path = b""
        for name, value in headers:
            if name == b":path":
                path = value  # type: ignore[assignment]
                break
        # A block decoded with an empty dynamic table that left it empty decodes the same way
        # every time: remember it (Envoy sends one such block per method).
        if table_free and not table.dynamic_entries and len(self._paths) < 64:
            self._paths[block] = path
        return path

    def _messages(self, stream: _Stream) -> None:
        inbox = stream.inbox
        while len(inbox) >= 5 and not stream.finished:
            if inbox[0]:
                self._finish(stream, GRPC_UNIMPLEMENTED, "compressed messages are not supported")
                return
            size = int.from_bytes(inbox[1:5], "big")
            if size > self._max_message:
                self._finish(stream, GRPC_RESOURCE_EXHAUSTED,
                             f"message of {size} bytes exceeds {self._max_message}")
                return
            if len(inbox) < 5 + size:
                return
            message = bytes(inbox[5: 5 + size])
            del inbox[: 5 + size]
            try:
                answers, done = stream.handler.on_message(message)
            except Exception:  # a handler bug ends its call, not the connection's others
                log.exception("stream handler failed")
                self._finish(stream, GRPC_INTERNAL, "internal error")
                return
            for answer in answers:
                self._send_message(stream, answer)
            if done:
                self._finish(stream, GRPC_OK)

    def _remote_end(self, stream: _Stream) -> None:
        stream.remote_closed = True
        if not stream.finished:
            self._finish(stream, GRPC_OK)  # the client is done: so is the call
        elif stream.trailers is None and stream.id in self._streams:
            del self._streams[stream.id]
            self._close_if_idle()

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolFault(FRAME_SIZE_ERROR, "WINDOW_UPDATE of wrong size")
        increment = int.from_bytes(payload, "big") & MAX_WINDOW
        if stream_id == 0:
            if increment == 0:
                raise ProtocolFault(PROTOCOL_ERROR, "zero WINDOW_UPDATE")
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise ProtocolFault(FLOW_CONTROL_ERROR, "connection window overflow")
            blocked, self._blocked = self._blocked, []
            for stream in blocked:
                self._flush(stream)
            return
        stream = self._streams.get(stream_id)
        if stream is not None and increment:
            stream.send_window += increment
            self._flush(stream)

    def _settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id != 0:
            raise ProtocolFault(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:  # the client now encodes without a dynamic table
            self._decoder.max_allowed_table_size = 0
            return
        if len(payload) % 6:
            raise ProtocolFault(FRAME_SIZE_ERROR, "SETTINGS of wrong size")
        for offset in range(0, len(payload), 6):
            key = int.from_bytes(payload[offset: offset + 2], "big")
            value = int.from_bytes(payload[offset + 2: offset + 6], "big")
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolFault(FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self._initial_send_window
                self._initial_send_window = value
                for stream in self._streams.values():
                    stream.send_window += delta
            elif key == MAX_FRAME_SIZE:
                if not DEFAULT_FRAME_SIZE <= value <= 16_777_215:
                    raise ProtocolFault(PROTOCOL_ERROR, f"max frame size {value}")
                self._max_frame_out = value
            # Others need nothing: our header blocks use no dynamic table, we open no streams.
        self._out.append(frame(SETTINGS, ACK, 0))
        for stream in list(self._streams.values()):
            self._flush(stream)

    def _ping(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id != 0:
            raise ProtocolFault(PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise ProtocolFault(FRAME_SIZE_ERROR, "PING of wrong size")
        if not flags & ACK:
            self._out.append(frame(PING, ACK, 0, payload))
        elif payload == _DRAIN_PING and not self._draining:
            self._draining = True
            self._out.append(frame(GOAWAY, 0, 0, self._last_stream.to_bytes(4, "big")
                                   + NO_ERROR.to_bytes(4, "big")))
            self._close_if_idle()

    # --- frames out --------------------------------------------------------------------------

    def _send_message(self, stream: _Stream, message: bytes) -> None:
        if not stream.headers_sent:
            self._out.append(frame(HEADERS, END_HEADERS, stream.id, RESPONSE_HEADERS))
            stream.headers_sent = True
        data = b"\x00" + len(message).to_bytes(4, "big") + message
        size = len(data)
        if (stream.pending or size > self._send_window or size > stream.send_window
                or size > self._max_frame_out):
            stream.pending += data
            self._flush(stream)
            return
        self._send_window -= size
        stream.send_window -= size
        self._out.append(frame(DATA, 0, stream.id, data))

    def _flush(self, stream: _Stream) -> None:
        """Send what flow control allows of ``stream``'s queued answer, then its trailers."""
        pending = stream.pending
        while pending:
            allowed = min(len(pending), self._send_window, stream.send_window,
                          self._max_frame_out)
            if allowed <= 0:
                if stream not in self._blocked:
                    self._blocked.append(stream)
                return
            self._out.append(frame(DATA, 0, stream.id, bytes(pending[:allowed])))
            del pending[:allowed]
            self._send_window -= allowed
            stream.send_window -= allowed
        if stream.trailers is not None:
            self._out.append(frame(HEADERS, END_HEADERS | END_STREAM, stream.id, stream.trailers))
            stream.trailers = None
            self._ended(stream)

    def _finish(self, stream: _Stream, status: int, message: str = "") -> None:
        """End the call: close its handler, then trailers (after any queued answer)."""
        stream.finished = True
        stream.inbox.clear()
        stream.handler.on_close()
        block = TRAILERS_OK if status == GRPC_OK and not message else trailers(status, message)
        if not stream.headers_sent:
            stream.headers_sent = True
            block = RESPONSE_HEADERS + block  # trailers-only answer
        stream.trailers = block
        self._flush(stream)

    def _ended(self, stream: _Stream) -> None:
        """Our side is closed; stop the client's side too if it is still sending."""
        if not stream.remote_closed:
            self._out.append(frame(RST_STREAM, 0, stream.id, NO_ERROR.to_bytes(4, "big")))
        self._streams.pop(stream.id, None)
        self._close_if_idle()

    def _drop(self, stream: _Stream) -> None:
        """The call is gone without an answer (reset, or the connection was lost)."""
        self._streams.pop(stream.id, None)
        if stream in self._blocked:
            self._blocked.remove(stream)
        if not stream.finished:
            stream.finished = True
            stream.handler.on_close()
        self._close_if_idle()

    def _close_if_idle(self) -> None:
        if self._draining and not self._streams:
            self._close()

    def _close(self) -> None:
        self._closing = True
        self._write()
        if self._transport is not None:
            self._transport.close()

    def _write(self) -> None:
        if self._out and self._transport is not None:
            self._transport.write(b"".join(self._out))
        self._out.clear()


def _unpad(payload: bytes) -> bytes:
    if not payload:
        raise ProtocolFault(PROTOCOL_ERROR, "padded frame without pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise ProtocolFault(PROTOCOL_ERROR, "padding exceeds the frame")
    return payload[1: len(payload) - pad]


class Http2Server:
    """Listens for HTTP/2 gRPC clients and serves ``handlers`` on their streams."""

    def __init__(self, handlers: Handlers, max_message: int) -> None:
        self._handlers = handlers
        self._max_message = max_message
        self._connections: set[Http2Connection] = set()
        self._server: asyncio.Server | None = None
        self._idle = asyncio.Event()  # set whenever no connection is open
        self._idle.set()

    async def start(self, host: str, port: int, reuse_port: bool = False,
                    tls: ssl.SSLContext | None = None) -> int:
        """Listen on ``host:port`` (over TLS with a context offering ALPN ``h2``); returns the
        bound port (``OSError`` when it cannot)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._connection, host, port,
                                                reuse_port=reuse_port or None, ssl=tls)
        return self._server.sockets[0].getsockname()[1]

    def serving(self) -> bool:
        """True while the listening socket accepts connections (started and not closed)."""
        return self._server is not None and self._server.is_serving()

    def _connection(self) -> Http2Connection:
        connection = Http2Connection(self._handlers, self._max_message, on_lost=self._lost)
        self._connections.add(connection)
        self._idle.clear()
        return connection

    def _lost(self, connection: Http2Connection) -> None:
        self._connections.discard(connection)
        if not self._connections:
            self._idle.set()

    async def stop(self, grace: float) -> None:
        """Stop accepting, let clients finish their open calls for up to ``grace`` seconds."""
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.drain()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace)
        for connection in list(self._connections):
            log.info("closing an HTTP/2 connection with %d open calls after the grace period",
                     connection.open_streams)
            connection.abort()
