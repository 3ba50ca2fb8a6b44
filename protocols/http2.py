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

Limits (:class:`~protocols.http2_limits.Http2Limits`, defaults in brackets; the `h2`
library and gRPC's C core bound the same things, with the values noted):

- Concurrent streams [1000] are advertised (SETTINGS_MAX_CONCURRENT_STREAMS) and enforced:
  one more is refused with RST_STREAM REFUSED_STREAM (h2 advertises 100; gRPC core is unbounded).
- Receive flow control is real: each stream starts with a [1 MiB] window, topped up as its
  messages are handed over, and widened to a whole message once a message's 5-byte prefix
  announces it (up to the max message size). The connection window starts at the connection's
  buffer cap [max message + 1 MiB] (as far as the server-wide budget allows), and is refilled
  by need: to the protocol's default (64 KiB) plus what announced messages still lack, within
  the cap, so partial messages of all its streams never exceed it; a peer sending past a
  window gets FLOW_CONTROL_ERROR. If partial messages fill the cap so that none can complete,
  the stream holding the most is ended with RESOURCE_EXHAUSTED.
- Server-wide, all connections together hold at most [256 MiB]: receive windows granted,
  partial messages and answers waiting for window (gRPC core's resource quota bounds the
  same). The protocol's default window (64 KiB) is set aside for every allowed connection
  [1024: 64 MiB], so a new connection is never turned away for want of budget and a client
  sending small messages always progresses; beyond it, a connection reserves from the shared
  rest before it grants window or parks an answer. When the budget is spent, windows are
  granted smaller or not refilled, and a client that can send nothing more gets room, one step
  at a time, by whichever frees more: the end (RESOURCE_EXHAUSTED) of the largest unfinished
  message across all connections (a large one being trickled in, not the small ones), or the
  close (GOAWAY ENHANCE_YOUR_CALM) of the connection holding the most window granted for
  messages it no longer sends (HTTP/2 cannot take window back). An answer that cannot be
  parked within the budget: GOAWAY ENHANCE_YOUR_CALM.
- Connections [1024] per server: one more is closed at once (SETTINGS, GOAWAY
  ENHANCE_YOUR_CALM), and counted like any connection error.
- Header blocks: [16 KiB] compressed, checked on every HEADERS and CONTINUATION frame before
  any decoding, [16 KiB] decoded (SETTINGS_MAX_HEADER_LIST_SIZE; gRPC core's hard default is
  16 KiB, h2's 64 KiB), at most [64] CONTINUATION frames (h2's backlog) and at most two table
  size updates per block (RFC 7541 4.2).
- Frames that cost work without progress (SETTINGS, PING, PRIORITY, unknown types, empty
  DATA/HEADERS/CONTINUATION) spend a per-connection budget [1000, refilled 500/s]; streams that
  end before any answer (reset by the client: rapid reset, CVE-2023-44487; refused; unknown
  method) spend another [2000, refilled 1000/s]. Either one exhausted: GOAWAY
  ENHANCE_YOUR_CALM. A reset of a stream that already ended costs nothing: Envoy sends one
  after most ext_proc calls (it half-closes, then resets). (gRPC core bounds the frames it
  must answer, ``max_pending_induced_frames``, 10,000; nghttp2 rate-limits resets with a
  bucket of 1000.)
- Write back-pressure: reading pauses while the transport holds more than [1 MiB] unsent, and
  resumes below [256 KiB], so a peer that does not read cannot make the server buffer answers.
  Answers waiting for flow-control window (a peer that sends requests but grants no window)
  are capped too [the buffer cap]: past it, GOAWAY ENHANCE_YOUR_CALM.
- Timeouts: [5 s] for the preface and first SETTINGS, then [300 s] without an open stream
  drains the connection (two-step GOAWAY) and closes it.
- Answers never echo client bytes (grpc-message is a short fixed text) and no frame sent is
  larger than the peer's SETTINGS_MAX_FRAME_SIZE.
- Protocol errors are counted per kind (``on_error``, the picker's
  ``lig_picker_http2_errors_total``) and logged at most once per 10 s per server, with the
  number suppressed.

Flow control sends in O(1) per frame: a stream waiting for window is parked either in a FIFO of
streams waiting for the connection window or in a heap of streams waiting for their own window,
ordered by how much they lack, so a SETTINGS, WINDOW_UPDATE or RST_STREAM touches only streams
it actually unblocks. A stream window overflow that a SETTINGS_INITIAL_WINDOW_SIZE increase
causes is detected when that stream next sends (a connection FLOW_CONTROL_ERROR, as RFC 9113
6.9.2 requires, but not at the SETTINGS frame itself).

:class:`Http2Connection` is the protocol for one client connection and is testable with a fake
transport; :class:`Http2Server` listens and drains.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import hpack

from protocols.http2_limits import BufferBudget, Http2Limits, TokenBucket
from shared.errors import LigError
from shared.logs import RateLimitedLog
from shared.waits import wait_set

log = logging.getLogger("lig.picker.http2")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Frame types (RFC 9113 section 6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
# Flags.
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# Error codes.
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM, \
    COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x0, 0x1, 0x3, 0x6, 0x7, 0x9, 0xB
ERROR_NAMES = {NO_ERROR: "NO_ERROR", PROTOCOL_ERROR: "PROTOCOL_ERROR",
               FLOW_CONTROL_ERROR: "FLOW_CONTROL_ERROR", FRAME_SIZE_ERROR: "FRAME_SIZE_ERROR",
               REFUSED_STREAM: "REFUSED_STREAM", COMPRESSION_ERROR: "COMPRESSION_ERROR",
               ENHANCE_YOUR_CALM: "ENHANCE_YOUR_CALM"}
PREFACE_TIMEOUT = "PREFACE_TIMEOUT"  # the error kind reported when the handshake is too slow
# Settings.
HEADER_TABLE_SIZE, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, \
    MAX_HEADER_LIST_SIZE = 0x1, 0x3, 0x4, 0x5, 0x6
# gRPC status codes.
GRPC_OK, GRPC_RESOURCE_EXHAUSTED, GRPC_UNIMPLEMENTED, GRPC_INTERNAL = 0, 8, 12, 13

MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME_SIZE = 16_384
RECEIVE_FRAME_SIZE = 1 << 20  # what we accept (advertised); fewer frames for large bodies
_DRAIN_PING = b"lig-stop"
_FLUSH_FRAMES = 256  # answers queued while reading before they are handed to the transport
# Where a stream with unsent bytes waits.
_NOT_PARKED, _ON_CONNECTION, _ON_STREAM = 0, 1, 2


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
# Answers name no client bytes: a fixed text, so an answer is never larger than its request
# made it, and fits any peer's frame size.
_UNKNOWN_METHOD = RESPONSE_HEADERS + trailers(GRPC_UNIMPLEMENTED, "unknown method")


class StreamHandler(Protocol):
    """One call of a streaming method: messages in, serialized answers out."""

    def on_message(self, message: bytes) -> tuple[Sequence[bytes], bool]:
        """Answers to one request message, and True when the call should end after them."""
        ...

    def on_close(self) -> None:
        """The call ended (finished, reset by the client, or its connection was lost)."""
        ...


Handlers = Mapping[bytes, Callable[[], StreamHandler]]  # method path -> a new call's handler


class ProtocolFault(LigError):
    """A connection error: answered with GOAWAY and the connection closed."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class _Stream:
    __slots__ = ("credit", "finished", "handler", "headers_sent", "heap_token", "id", "inbox",
                 "need", "parked", "pending", "recv_window", "remote_closed", "trailers")

    def __init__(self, stream_id: int, handler: StreamHandler, recv_window: int) -> None:
        self.id = stream_id
        self.handler = handler
        # Send window = the connection's current initial window + credit (WINDOW_UPDATEs minus
        # bytes sent): a SETTINGS change of the initial window then needs no per-stream update.
        self.credit = 0
        self.recv_window = recv_window  # bytes the client may still send on this stream
        self.inbox = bytearray()
        self.need = 0  # bytes still to come of the message being received, once announced
        self.pending = bytearray()  # answer bytes waiting for flow-control window
        self.trailers: bytes | None = None  # trailers waiting behind `pending`
        self.headers_sent = False
        self.finished = False  # the handler was closed; trailers sent or queued
        self.remote_closed = False
        self.parked = _NOT_PARKED
        self.heap_token = 0  # identifies this stream's live entry in the stream-window heap


class Http2Connection(asyncio.Protocol):
    """The server side of one HTTP/2 connection carrying gRPC calls."""

    def __init__(self, handlers: Handlers, max_message: int,
                 on_lost: Callable[[Http2Connection], None] = lambda connection: None,
                 limits: Http2Limits | None = None,
                 loop: asyncio.AbstractEventLoop | None = None,
                 on_error: Callable[[str], None] = lambda kind: None,
                 warnings: RateLimitedLog | None = None,
                 budget: BufferBudget | None = None,
                 reclaim: Callable[[Http2Connection], bool] = lambda connection: False,
                 clock: Callable[[], float] = time.monotonic,
                 ) -> None:
        """``loop`` runs the preface and idle timers (none without it); ``on_error`` is called
        with the kind of each connection error (an RFC 9113 error name, or PREFACE_TIMEOUT);
        ``warnings`` throttles the log lines about them. ``budget`` is shared by the server's
        connections (none: this connection is bounded by its own caps only); ``reclaim`` makes
        room in it for this connection (see :meth:`Http2Server._reclaim`), False when it
        cannot. ``clock`` refills the control-frame and reset budgets (tests freeze it)."""
        self._handlers = handlers
        self._max_message = max_message
        self._on_lost = on_lost
        self._limits = limits = limits if limits is not None else Http2Limits()
        self._loop = loop
        self._on_error = on_error
        self._warnings = warnings if warnings is not None else RateLimitedLog(log)
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._out: list[bytes] = []
        self._preface_seen = False
        self._settings_seen = False
        self._streams: dict[int, _Stream] = {}
        self._last_stream = 0
        self._header_block: tuple[int, int, bytearray] | None = None  # awaiting CONTINUATION
        self._continuations = 0
        self._decoder = hpack.Decoder(max_header_list_size=limits.max_header_list)
        # Its table limit drops to 0 once our SETTINGS are acked.
        self._paths: dict[bytes, bytes] = {}  # header block -> :path, for table-free blocks
        # Sending.
        self._send_window = DEFAULT_WINDOW
        self._initial_send_window = DEFAULT_WINDOW
        self._max_frame_out = DEFAULT_FRAME_SIZE
        self._waiting_for_connection: OrderedDict[int, _Stream] = OrderedDict()
        self._waiting_for_stream: list[tuple[int, int, _Stream]] = []  # (-credit, token, stream)
        self._waiting_for_stream_live = 0
        self._heap_tokens = 0
        # Receiving.
        self._buffer_cap = limits.buffered_cap(max_message)
        self._recv_window = DEFAULT_WINDOW  # until our WINDOW_UPDATE in the greeting
        self._buffered = 0  # bytes of partial messages in the streams' inboxes
        self._need = 0  # the streams' `need`: what announced messages still lack
        self._parked_cap = limits.parked_cap(max_message)
        self._parked = 0  # bytes of answers in the streams' `pending`, waiting for window
        # Server-wide: what this connection may hold (receive window + partial messages +
        # parked answers) is reserved first; `_settle` returns the excess. The protocol's default
        # window is reserved for it by the server (its budget leaves room for that much per
        # connection allowed); the rest comes from the shared budget.
        self._budget = budget if budget is not None else BufferBudget(1 << 62)
        self._reclaim = reclaim
        self._reserved = DEFAULT_WINDOW
        self._control = TokenBucket(limits.control_burst, limits.control_rate, clock)
        self._resets = TokenBucket(limits.reset_burst, limits.reset_rate, clock)
        self._paused = False  # the transport's write buffer is above its high-water mark
        self._processing = False  # inside _process: a resume must not start another
        self._draining = False  # no new streams: our final GOAWAY went out, or the client sent one
        self._drain_started = False
        self._closing = False
        self._timer: asyncio.TimerHandle | None = None
        self._idle_since = 0.0

    # --- asyncio.Protocol ------------------------------------------------------------------

    # typeshed keeps BaseProtocol's BaseTransport here, but a stream protocol is always given a
    # Transport (uvloop's is not a subclass of asyncio.Transport, so isinstance cannot narrow).
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._transport = transport
        limits = self._limits
        self._transport.set_write_buffer_limits(limits.write_high_water, limits.write_low_water)
        settings = b"".join(key.to_bytes(2, "big") + value.to_bytes(4, "big") for key, value in (
            (HEADER_TABLE_SIZE, 0), (MAX_CONCURRENT_STREAMS, limits.max_concurrent_streams),
            (INITIAL_WINDOW_SIZE, limits.stream_window), (MAX_FRAME_SIZE, RECEIVE_FRAME_SIZE),
            (MAX_HEADER_LIST_SIZE, limits.max_header_list)))
        self._out.append(frame(SETTINGS, 0, 0, settings))
        # A first window of the whole buffer cap, as far as the budget allows: a client may
        # send a large message at once. Unused, it is idle window, which the server takes
        # back (by closing the connection) when another client needs the budget.
        grant = self._budget.grant(self._buffer_cap - DEFAULT_WINDOW)
        if grant > 0:
            self._reserved += grant
            self._recv_window += grant
            self._out.append(frame(WINDOW_UPDATE, 0, 0, grant.to_bytes(4, "big")))
        self._write()
        if self._loop is not None:
            self._idle_since = self._loop.time()
            self._timer = self._loop.call_later(limits.preface_timeout, self._on_preface_timer)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._run()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for stream in list(self._streams.values()):
            self._drop(stream)
        self._release()
        self._on_lost(self)

    def pause_writing(self) -> None:
        """The transport holds too much unsent: stop reading until the peer catches up."""
        self._paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        """The transport's buffer drained below its low-water mark: read (and process) again."""
        self._paused = False
        if self._transport is not None and not self._closing:
            self._transport.resume_reading()
            # A transport may resume from inside our own write (asyncio's TLS one can): the
            # frame loop on the stack then simply goes on.
            if self._buffer and not self._processing:
                self._run()

    # --- draining ----------------------------------------------------------------------------

    @property
    def open_streams(self) -> int:
        """Calls not yet ended on this connection."""
        return len(self._streams)

    @property
    def buffered_bytes(self) -> int:
        """Bytes of partial request messages held for this connection's streams."""
        return self._buffered

    @property
    def parked_bytes(self) -> int:
        """Bytes of answers held for this connection's streams, waiting for window."""
        return self._parked

    @property
    def reserved_bytes(self) -> int:
        """Bytes this connection may hold (never less than it holds): the protocol's default
        window, which the server keeps for every connection, plus its part of the budget."""
        return self._reserved

    def largest_partial(self) -> int:
        """Bytes of this connection's largest unfinished request message (0: none, or the
        connection is closing: it frees everything when the transport reports the close)."""
        if not self._buffered or self._closing:
            return 0
        return max(len(stream.inbox) for stream in self._streams.values())

    def end_largest_partial(self) -> None:
        """End the call holding the largest unfinished message with RESOURCE_EXHAUSTED (the
        server's budget is spent), and return the bytes it held to the budget."""
        largest = max(self._streams.values(), key=lambda stream: len(stream.inbox))
        try:
            self._finish(largest, GRPC_RESOURCE_EXHAUSTED, "server buffer full")
        except ProtocolFault as exc:
            if self._processing:  # this connection's own frame loop handles it
                raise
            self._fail(exc)
            return
        self._settle()
        if not self._processing:
            self._write()

    @property
    def idle_window(self) -> int:
        """Receive window granted beyond what announced messages lack and the default window:
        budget a client holds without sending (e.g. after its call was ended); 0 once closing."""
        if self._closing:
            return 0
        return self._recv_window - DEFAULT_WINDOW - self._need

    def calm_down(self) -> None:
        """Close for holding budget others need: GOAWAY ENHANCE_YOUR_CALM, calls dropped and
        the budget returned now, not when the transport reports the close."""
        self._report(ERROR_NAMES[ENHANCE_YOUR_CALM], "idle window while the budget is spent")
        self._out.append(frame(GOAWAY, 0, 0, self._last_stream.to_bytes(4, "big")
                               + ENHANCE_YOUR_CALM.to_bytes(4, "big")))
        self._close()
        for stream in list(self._streams.values()):
            self._drop(stream)
        self._release()

    def _release(self) -> None:
        self._budget.give_back(self._reserved - DEFAULT_WINDOW)
        self._reserved = DEFAULT_WINDOW

    def _reserve(self, target: int, reclaim: bool) -> int:
        """Reserve from the budget until this connection holds ``target`` bytes of it (fewer
        when the budget is spent; with ``reclaim``, after ending the largest unfinished
        messages while that helps); returns the reservation."""
        while self._reserved < target:
            self._reserved += self._budget.grant(target - self._reserved)
            if self._reserved >= target or not reclaim or not self._reclaim(self):
                break
        return self._reserved

    def _held(self) -> int:
        return max(self._recv_window, 0) + self._buffered + self._parked

    def _settle(self) -> None:
        """Return reserved bytes this connection no longer holds, keeping the default window
        (a client sending small messages always progresses)."""
        excess = self._reserved - max(self._held(), DEFAULT_WINDOW)
        if excess > 0:
            self._reserved -= excess
            self._budget.give_back(excess)

    def drain(self) -> None:
        """Start a graceful close: GOAWAY now, a final GOAWAY once the client has seen it."""
        if self._transport is None or self._closing:
            return
        self._drain_started = True
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

    # --- timers ------------------------------------------------------------------------------

    def _on_preface_timer(self) -> None:
        self._timer = None
        if self._closing:
            return
        if not self._settings_seen:
            self._report(PREFACE_TIMEOUT, "no client preface and SETTINGS in time")
            self._close()
            return
        self._arm_idle_timer(self._limits.idle_timeout)

    def _arm_idle_timer(self, delay: float) -> None:
        assert self._loop is not None
        self._timer = self._loop.call_later(delay, self._on_idle_timer)

    def _on_idle_timer(self) -> None:
        assert self._loop is not None
        self._timer = None
        if self._closing:
            return
        timeout = self._limits.idle_timeout
        if self._drain_started:  # a client that never answered the drain's PING
            self._close()
            return
        if self._streams:
            self._arm_idle_timer(timeout)
            return
        idle_for = self._loop.time() - self._idle_since
        if idle_for >= timeout:
            self.drain()
            self._arm_idle_timer(timeout)  # the drain gets as long again to finish
        else:
            self._arm_idle_timer(timeout - idle_for)

    # --- frames in ---------------------------------------------------------------------------

    def _run(self) -> None:
        self._processing = True
        try:
            self._process()
        except ProtocolFault as exc:
            self._fail(exc)
            return
        finally:
            self._processing = False
        self._settle()
        self._write()

    def _fail(self, exc: ProtocolFault) -> None:
        """A connection error: report it, GOAWAY and close."""
        self._report(ERROR_NAMES.get(exc.code, str(exc.code)), str(exc))
        self._out.append(frame(GOAWAY, 0, 0, self._last_stream.to_bytes(4, "big")
                               + exc.code.to_bytes(4, "big")))
        self._close()

    def _report(self, kind: str, reason: str) -> None:
        self._on_error(kind)
        self._warnings.warning("HTTP/2 connection error %s, closing: %s", kind, reason)

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
        out = self._out
        try:
            while end_of_data - position >= 9 and not self._closing and not self._paused:
                length = int.from_bytes(buffer[position: position + 3], "big")
                if length > RECEIVE_FRAME_SIZE:
                    raise ProtocolFault(FRAME_SIZE_ERROR, "frame larger than advertised")
                end = position + 9 + length
                if end > end_of_data:
                    break
                kind, flags = buffer[position + 3], buffer[position + 4]
                stream_id = int.from_bytes(buffer[position + 5: position + 9], "big") & MAX_WINDOW
                payload = bytes(buffer[position + 9: end])
                position = end
                self._frame(kind, flags, stream_id, payload)
                if len(out) >= _FLUSH_FRAMES:  # may pause reading: see pause_writing
                    self._write()
        finally:
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
            self._rst_stream(stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == PING:
            self._ping(flags, stream_id, payload)
        elif kind == GOAWAY:
            if not self._draining:  # the client opens no more streams here: nor do we
                self._draining = True
                self._out.append(frame(GOAWAY, 0, 0, self._last_stream.to_bytes(4, "big")
                                       + NO_ERROR.to_bytes(4, "big")))
            self._close_if_idle()
        elif kind == PUSH_PROMISE:
            raise ProtocolFault(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        else:  # PRIORITY and unknown frame types are ignored, as RFC 9113 requires
            self._charge_control()

    def _charge_control(self) -> None:
        if not self._control.take():
            raise ProtocolFault(ENHANCE_YOUR_CALM, "too many control or empty frames")

    def _charge_reset(self) -> None:
        if not self._resets.take():
            raise ProtocolFault(ENHANCE_YOUR_CALM, "too many streams ended before an answer")

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ProtocolFault(PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        if not size and not flags & END_STREAM:
            self._charge_control()
        self._recv_window -= size
        if self._recv_window < 0:
            raise ProtocolFault(FLOW_CONTROL_ERROR, "DATA past the connection window")
        stream = self._streams.get(stream_id)
        if stream is None:
            if stream_id > self._last_stream:
                raise ProtocolFault(PROTOCOL_ERROR, "DATA on an idle stream")
            self._refill_connection()  # a stream that ended here already: data discarded
            return
        stream.recv_window -= size
        if stream.recv_window < 0:
            raise ProtocolFault(FLOW_CONTROL_ERROR, "DATA past the stream window")
        if flags & PADDED:
            payload = _unpad(payload)
        if not stream.finished:
            stream.inbox += payload
            self._buffered += len(payload)
            self._messages(stream)
            if not stream.finished:
                self._refill_stream(stream)
        if flags & END_STREAM:
            self._remote_end(stream)
        self._refill_connection()

    def _refill_stream(self, stream: _Stream) -> None:
        """Top the stream's receive window up as its messages are handed over, and widen it to
        the rest of a message announced larger than the window."""
        window = self._limits.stream_window
        inbox = stream.inbox
        need = 5 + int.from_bytes(inbox[1:5], "big") - len(inbox) if len(inbox) >= 5 else 0
        if need != stream.need:
            self._need += need - stream.need
            stream.need = need
        grant = max(window, need) - stream.recv_window
        if grant > 0 and (grant >= window // 2 or stream.recv_window < need):
            self._out.append(frame(WINDOW_UPDATE, 0, stream.id, grant.to_bytes(4, "big")))
            stream.recv_window += grant

    def _refill_connection(self) -> None:
        """Refill the connection window to what the announced messages still lack plus the
        default window, within the buffer cap and the server's budget (a window granted
        ahead of need could sit idle, holding budget others need). When partial messages fill
        the cap so that none can complete, end the stream that holds the most; when the budget
        is spent so that the client can send nothing more, end the largest unfinished message
        of any connection."""
        if 2 * self._recv_window > DEFAULT_WINDOW + self._need:
            return  # the usual case: more than half the target left, nothing to do
        if (self._buffer_cap - self._buffered - self._recv_window <= 0
                and self._recv_window <= 0 and self._buffered):
            largest = max((stream for stream in self._streams.values() if stream.inbox),
                          key=lambda stream: len(stream.inbox))
            self._finish(largest, GRPC_RESOURCE_EXHAUSTED, "connection buffer full")
        target = min(self._buffer_cap - self._buffered, DEFAULT_WINDOW + self._need)
        free = target - self._recv_window
        if free > 0 and (2 * free >= target or self._recv_window <= 0):
            held = self._held()
            if self._reserved - held < free:
                self._reserve(held + free, reclaim=False)
                # Stuck (no window left) and nothing to grant: make room, one message at a time.
                while (self._recv_window <= 0 and self._reserved <= self._held()
                       and self._reclaim(self)):
                    self._reserve(self._held() + free, reclaim=False)
                free = min(min(self._buffer_cap - self._buffered,
                               DEFAULT_WINDOW + self._need) - self._recv_window,
                           self._reserved - self._held())
                if free <= 0:
                    return
            self._out.append(frame(WINDOW_UPDATE, 0, 0, free.to_bytes(4, "big")))
            self._recv_window += free

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if len(payload) > self._limits.max_header_block:
            raise ProtocolFault(PROTOCOL_ERROR, "header block too large")
        if stream_id == 0 or stream_id % 2 == 0:
            raise ProtocolFault(PROTOCOL_ERROR, "HEADERS on an even stream")
        if flags & PADDED:
            payload = _unpad(payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if flags & END_HEADERS:
            self._header_block_done(stream_id, flags, payload)
        else:
            if not payload:
                self._charge_control()
            self._header_block = (stream_id, flags, bytearray(payload))
            self._continuations = 0

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        pending = self._header_block
        if pending is None or pending[0] != stream_id:
            raise ProtocolFault(PROTOCOL_ERROR, "unexpected CONTINUATION")
        self._continuations += 1
        if self._continuations > self._limits.max_continuations:
            raise ProtocolFault(ENHANCE_YOUR_CALM, "too many CONTINUATION frames")
        if not payload and not flags & END_HEADERS:
            self._charge_control()
        if len(pending[2]) + len(payload) > self._limits.max_header_block:
            raise ProtocolFault(PROTOCOL_ERROR, "header block too large")
        pending[2].extend(payload)
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
            raise ProtocolFault(PROTOCOL_ERROR, "HEADERS on a closed stream")
        self._last_stream = stream_id
        if self._draining or len(self._streams) >= self._limits.max_concurrent_streams:
            self._charge_reset()
            self._out.append(frame(RST_STREAM, 0, stream_id, REFUSED_STREAM.to_bytes(4, "big")))
            return
        factory = self._handlers.get(path)
        if factory is None:
            self._charge_reset()
            self._out.append(frame(HEADERS, END_HEADERS | END_STREAM, stream_id, _UNKNOWN_METHOD))
            if not flags & END_STREAM:
                self._out.append(frame(RST_STREAM, 0, stream_id, NO_ERROR.to_bytes(4, "big")))
            return
        stream = _Stream(stream_id, factory(), self._limits.stream_window)
        self._streams[stream_id] = stream
        if flags & END_STREAM:
            self._remote_end(stream)

    def _path(self, block: bytes) -> bytes:
        known = self._paths.get(block)
        if known is not None:
            return known
        if _table_size_updates(block) > 2:  # RFC 7541 4.2 allows two; each costs a decode step
            raise ProtocolFault(COMPRESSION_ERROR, "too many table size updates")
        table = self._decoder.header_table
        table_free = not table.dynamic_entries
        try:
            headers = self._decoder.decode(block, raw=True)
        except hpack.HPACKError:
            raise ProtocolFault(COMPRESSION_ERROR, "bad header block") from None
        path = b""
        for name, value in headers:
            if name == b":path":
                path = value
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
                self._finish(stream, GRPC_RESOURCE_EXHAUSTED, "message too large")
                return
            if len(inbox) < 5 + size:
                return
            message = bytes(inbox[5: 5 + size])
            del inbox[: 5 + size]
            self._buffered -= 5 + size
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

    def _rst_stream(self, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ProtocolFault(PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if len(payload) != 4:
            raise ProtocolFault(FRAME_SIZE_ERROR, "RST_STREAM of wrong size")
        stream = self._streams.get(stream_id)
        if stream is None:
            if stream_id > self._last_stream:
                raise ProtocolFault(PROTOCOL_ERROR, "RST_STREAM on an idle stream")
            # Free: Envoy resets each ext_proc stream right after half-closing it, so most of
            # its calls end with a reset of a stream that ended here; it costs a lookup.
            return
        if not stream.headers_sent:
            self._charge_reset()
        self._drop(stream)

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
            waiting = self._waiting_for_connection
            while waiting and self._send_window > 0:
                _, parked = waiting.popitem(last=False)
                parked.parked = _NOT_PARKED
                self._flush(parked)
            return
        stream = self._streams.get(stream_id)
        if stream is None:
            if stream_id > self._last_stream:
                raise ProtocolFault(PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
            return  # a stream that ended here already
        if increment == 0:
            self._reset(stream, PROTOCOL_ERROR)
            return
        if self._initial_send_window + stream.credit + increment > MAX_WINDOW:
            self._reset(stream, FLOW_CONTROL_ERROR)
            return
        stream.credit += increment
        if stream.parked == _ON_STREAM:
            stream.parked = _NOT_PARKED  # its heap entry is now stale
            self._waiting_for_stream_live -= 1
            self._flush(stream)

    def _settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id != 0:
            raise ProtocolFault(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:  # the client now encodes without a dynamic table
            if payload:
                raise ProtocolFault(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            self._decoder.max_allowed_table_size = 0
            return
        if len(payload) % 6:
            raise ProtocolFault(FRAME_SIZE_ERROR, "SETTINGS of wrong size")
        self._charge_control()
        grown = False
        for offset in range(0, len(payload), 6):
            key = int.from_bytes(payload[offset: offset + 2], "big")
            value = int.from_bytes(payload[offset + 2: offset + 6], "big")
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolFault(FLOW_CONTROL_ERROR, "initial window too large")
                grown = grown or value > self._initial_send_window
                self._initial_send_window = value  # streams' windows follow: see _Stream
            elif key == MAX_FRAME_SIZE:
                if not DEFAULT_FRAME_SIZE <= value <= 16_777_215:
                    raise ProtocolFault(PROTOCOL_ERROR, "max frame size out of range")
                self._max_frame_out = value
            # Others need nothing: our header blocks use no dynamic table, we open no streams.
        self._settings_seen = True
        self._out.append(frame(SETTINGS, ACK, 0))
        if grown:
            self._unpark_grown_windows()

    def _ping(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id != 0:
            raise ProtocolFault(PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise ProtocolFault(FRAME_SIZE_ERROR, "PING of wrong size")
        self._charge_control()
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
        window = self._initial_send_window + stream.credit
        if (stream.pending or size > self._send_window or size > window
                or size > self._max_frame_out or window > MAX_WINDOW):
            stream.pending += data
            self._parked += size
            self._flush(stream)
            if self._parked > self._parked_cap:  # the client asks but does not take answers
                raise ProtocolFault(ENHANCE_YOUR_CALM, "too many answers waiting for window")
            held = self._held()
            if held > self._reserved and self._reserve(held, reclaim=True) < self._held():
                raise ProtocolFault(ENHANCE_YOUR_CALM, "server buffer budget spent")
            return
        self._send_window -= size
        stream.credit -= size
        self._out.append(frame(DATA, 0, stream.id, data))

    def _flush(self, stream: _Stream) -> None:
        """Send what flow control allows of ``stream``'s queued answer, then its trailers; a
        stream that must wait is parked where the window it lacks will find it."""
        if stream.parked:
            return  # it is sent when the window it waits for arrives
        pending = stream.pending
        while pending:
            window = self._initial_send_window + stream.credit
            if window > MAX_WINDOW:
                raise ProtocolFault(FLOW_CONTROL_ERROR, "stream window overflow")
            if window <= 0:
                self._park_on_stream(stream)
                return
            if self._send_window <= 0:
                stream.parked = _ON_CONNECTION
                self._waiting_for_connection[stream.id] = stream
                return
            allowed = min(len(pending), self._send_window, window, self._max_frame_out)
            self._out.append(frame(DATA, 0, stream.id, bytes(pending[:allowed])))
            del pending[:allowed]
            self._parked -= allowed
            self._send_window -= allowed
            stream.credit -= allowed
        if stream.trailers is not None:
            self._out.append(frame(HEADERS, END_HEADERS | END_STREAM, stream.id, stream.trailers))
            stream.trailers = None
            self._ended(stream)

    def _park_on_stream(self, stream: _Stream) -> None:
        heap = self._waiting_for_stream
        if len(heap) > 2 * self._waiting_for_stream_live + 64:  # mostly stale entries: rebuild
            heap[:] = [entry for entry in heap
                       if entry[2].parked == _ON_STREAM and entry[2].heap_token == entry[1]]
            heapq.heapify(heap)
        self._heap_tokens += 1
        stream.parked = _ON_STREAM
        stream.heap_token = self._heap_tokens
        self._waiting_for_stream_live += 1
        heapq.heappush(heap, (-stream.credit, self._heap_tokens, stream))

    def _unpark_grown_windows(self) -> None:
        """After the initial window grew: send on exactly the streams it gave window to."""
        heap = self._waiting_for_stream
        while heap and self._initial_send_window - heap[0][0] > 0:
            _, token, stream = heapq.heappop(heap)
            if stream.parked != _ON_STREAM or stream.heap_token != token:
                continue  # stale: the stream was unparked or dropped since
            stream.parked = _NOT_PARKED
            self._waiting_for_stream_live -= 1
            self._flush(stream)

    def _unpark(self, stream: _Stream) -> None:
        if stream.parked == _ON_CONNECTION:
            del self._waiting_for_connection[stream.id]
        elif stream.parked == _ON_STREAM:
            self._waiting_for_stream_live -= 1  # its heap entry is now stale
        stream.parked = _NOT_PARKED

    def _finish(self, stream: _Stream, status: int, message: str = "") -> None:
        """End the call: close its handler, then trailers (after any queued answer)."""
        stream.finished = True
        self._buffered -= len(stream.inbox)
        stream.inbox.clear()
        self._need -= stream.need
        stream.need = 0
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

    def _reset(self, stream: _Stream, code: int) -> None:
        """A stream error: RST_STREAM with ``code``, and the call is gone."""
        self._out.append(frame(RST_STREAM, 0, stream.id, code.to_bytes(4, "big")))
        self._drop(stream)

    def _drop(self, stream: _Stream) -> None:
        """The call is gone without an answer (reset, or the connection was lost)."""
        self._streams.pop(stream.id, None)
        self._unpark(stream)
        self._buffered -= len(stream.inbox)
        stream.inbox.clear()
        self._need -= stream.need
        stream.need = 0
        self._parked -= len(stream.pending)
        stream.pending.clear()
        if not stream.finished:
            stream.finished = True
            stream.handler.on_close()
        self._close_if_idle()

    def _close_if_idle(self) -> None:
        if self._streams:
            return
        if self._loop is not None:
            self._idle_since = self._loop.time()
        if self._draining:
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


def _table_size_updates(block: bytes) -> int:
    """How many dynamic table size updates open ``block`` (counting stops at three)."""
    count = position = 0
    while count < 3 and position < len(block) and block[position] & 0xE0 == 0x20:
        count += 1
        position += 1
        if block[position - 1] & 0x1F == 0x1F:  # the size continues in 7-bit groups
            while position < len(block) and block[position] & 0x80:
                position += 1
            position += 1
    return count


def _unpad(payload: bytes) -> bytes:
    if not payload:
        raise ProtocolFault(PROTOCOL_ERROR, "padded frame without pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise ProtocolFault(PROTOCOL_ERROR, "padding exceeds the frame")
    return payload[1: len(payload) - pad]


class _Refused(asyncio.Protocol):
    """A connection past the server's limit: told to calm down and closed at once."""

    def __init__(self, on_error: Callable[[str], None], warnings: RateLimitedLog) -> None:
        self._on_error = on_error
        self._warnings = warnings

    # The same typeshed gap as Http2Connection's: a stream protocol always gets a Transport.
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        kind = ERROR_NAMES[ENHANCE_YOUR_CALM]
        self._on_error(kind)
        self._warnings.warning("HTTP/2 connection error %s, closing: %s", kind,
                               "too many connections")
        # The server preface is a SETTINGS frame; the GOAWAY then says why.
        transport.write(frame(SETTINGS, 0, 0) + frame(GOAWAY, 0, 0, (0).to_bytes(4, "big")
                                                      + ENHANCE_YOUR_CALM.to_bytes(4, "big")))
        transport.close()


class Http2Server:
    """Listens for HTTP/2 gRPC clients and serves ``handlers`` on their streams."""

    def __init__(self, handlers: Handlers, max_message: int, limits: Http2Limits | None = None,
                 on_error: Callable[[str], None] = lambda kind: None) -> None:
        """``limits`` bound each connection (see the module docstring); ``on_error`` is called
        with the kind of every connection error, e.g. to count it in a metric."""
        self._handlers = handlers
        self._max_message = max_message
        self._limits = limits if limits is not None else Http2Limits()
        if self._limits.buffered_cap(max_message) < max_message + 5:
            raise ValueError("max_buffered must hold one message of max_message bytes")
        # Every connection may hold the default window (a client may send that much before
        # any WINDOW_UPDATE): that much per allowed connection is set aside, so that a new
        # connection is never turned away for want of budget; the rest is shared.
        floors = self._limits.max_connections * DEFAULT_WINDOW
        if self._limits.max_total_buffered < floors + self._limits.buffered_cap(max_message):
            raise ValueError("max_total_buffered must hold the default window of every allowed "
                             "connection and one connection's buffer cap")
        self._on_error = on_error
        self._warnings = RateLimitedLog(log)  # shared: a flood of bad connections logs little
        self.budget = BufferBudget(self._limits.max_total_buffered - floors)
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

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._connections)

    @property
    def reserved_bytes(self) -> int:
        """Bytes the open connections may hold in all (never more than max_total_buffered)."""
        return self.budget.used + len(self._connections) * DEFAULT_WINDOW

    def _connection(self) -> asyncio.Protocol:
        if len(self._connections) >= self._limits.max_connections:
            return _Refused(self._on_error, self._warnings)
        connection = Http2Connection(self._handlers, self._max_message, on_lost=self._lost,
                                     limits=self._limits, loop=asyncio.get_running_loop(),
                                     on_error=self._on_error, warnings=self._warnings,
                                     budget=self.budget, reclaim=self._reclaim)
        self._connections.add(connection)
        self._idle.clear()
        return connection

    def _reclaim(self, requester: Http2Connection) -> bool:
        """The budget is spent and ``requester``'s client can send nothing more: free the most
        that one step can. Either end the largest unfinished message across all connections (a
        large one being trickled in, not the small ones of a well-behaved client), or, if more
        is held that way, close the connection holding the most window it was granted for
        messages it no longer sends (HTTP/2 cannot take window back). Scans the connections,
        but runs only when a client could otherwise send nothing more."""
        largest, size = None, 0
        for connection in self._connections:
            if connection.buffered_bytes > size:  # only then can it hold a larger message
                partial = connection.largest_partial()
                if partial > size:
                    largest, size = connection, partial
        idlest, idle = None, size
        for connection in self._connections:
            if connection is not requester and connection.idle_window > idle:
                idlest, idle = connection, connection.idle_window
        if idlest is not None:
            idlest.calm_down()
        elif largest is not None:
            largest.end_largest_partial()
        else:
            return False
        return True

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
        await wait_set(self._idle, grace)
        for connection in list(self._connections):
            log.info("closing an HTTP/2 connection with %d open calls after the grace period",
                     connection.open_streams)
            connection.abort()
