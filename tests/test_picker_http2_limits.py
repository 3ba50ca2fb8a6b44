"""The built-in HTTP/2 server's limits (issue 13, items 1 and 2): each attack that used to cost
CPU, memory or log space without bound now meets a limit. In-process with a fake transport,
except the timeouts and the log throttle, which use a real server on loopback."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable

import hpack
import pytest
from prometheus_client import CollectorRegistry

from protocols.http2 import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    MAX_WINDOW,
    PING,
    PREFACE,
    PRIORITY,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    Http2Server,
    frame,
)
from protocols.http2_limits import Http2Limits, TokenBucket
from services.picker.observability import PickerMetrics
from tests.support.http2_peer import PATH, Echo, FakeTransport, Peer, grpc_message

Frames = list[tuple[int, int, int, bytes]]


def goaway_code(frames: Frames) -> int | None:
    """The error code of the last GOAWAY among ``frames`` (None: no GOAWAY)."""
    codes = [int.from_bytes(payload[4:8], "big") for kind, _, _, payload in frames
             if kind == GOAWAY]
    return codes[-1] if codes else None


def setting(key: int, value: int) -> bytes:
    return key.to_bytes(2, "big") + value.to_bytes(4, "big")


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, increment.to_bytes(4, "big"))


def table_free_headers(peer: Peer) -> Callable[[int], bytes]:
    """Acknowledge the server's SETTINGS (no HPACK table from then on) and open stream 1; the
    function returns the same header block for any further stream: it decodes once."""
    peer.send(frame(SETTINGS, ACK, 0))
    peer.encoder.header_table_size = 0
    peer.send(peer.headers(1))  # carries the table size update
    block = peer.headers(3)[9:]
    return lambda stream_id: frame(HEADERS, END_HEADERS, stream_id, block)


def calls(work: Callable[[], object]) -> int:
    """The Python and C function calls ``work`` makes: its cost counted, not timed, so that a
    loaded machine cannot fail a test of how the cost grows (``sys.setprofile``)."""
    count = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(None)
    return count


def parked_streams(count: int) -> Peer:
    """A client that grants no stream window, with ``count`` open calls whose answers wait."""
    peer = Peer()
    peer.start(setting(INITIAL_WINDOW_SIZE, 0))
    peer.send(*(peer.headers(2 * i + 1) + frame(DATA, 0, 2 * i + 1, grpc_message(b"x"))
                for i in range(count)))
    assert not any(kind == DATA for kind, *_ in peer.read())
    assert peer.connection.open_streams == count
    return peer


# --- item 1: flow control in O(1) per frame ------------------------------------------------


def test_control_frames_do_not_rescan_parked_streams() -> None:
    """The old server re-flushed every parked stream per control frame (and looked each up in a
    list): ~1 s for these frames with 1000 parked streams. Now they touch no parked stream: the
    same work with 1000 parked as with 10, and the same work per reset."""
    control = (*[frame(SETTINGS, 0, 0)] * 50, *[window_update(0, 1)] * 50)
    work: dict[int, tuple[int, float]] = {}
    for count in (10, 1000):
        peer = parked_streams(count)
        per_control = calls(lambda peer=peer: peer.send(*control))  # type: ignore[misc]
        frames = peer.read()
        assert [kind for kind, *_ in frames] == [SETTINGS] * 50  # the acks; no window for data
        resets = [frame(RST_STREAM, 0, 2 * i + 1, (8).to_bytes(4, "big")) for i in range(count)]
        per_reset = calls(lambda peer=peer, resets=resets: peer.send(*resets)) / count  # type: ignore[misc]
        assert peer.connection.open_streams == 0 and peer.log.count("closed") == count
        work[count] = (per_control, per_reset)
    (control_few, reset_few), (control_many, reset_many) = work[10], work[1000]
    assert control_many <= 1.1 * control_few, work
    assert reset_many <= 1.1 * reset_few, work


def test_a_grown_initial_window_sends_on_exactly_the_streams_it_unblocks() -> None:
    peer = Peer()
    peer.start(setting(INITIAL_WINDOW_SIZE, 8))
    answer = grpc_message(b"echo:x")  # 11 bytes
    peer.send(peer.headers(1), frame(DATA, 0, 1, grpc_message(b"x")))
    assert [(kind, stream, data) for kind, _, stream, data in peer.read() if kind == DATA] == [
        (DATA, 1, answer[:8])]
    peer.send(frame(SETTINGS, 0, 0, setting(INITIAL_WINDOW_SIZE, 0)))  # stream 1's window: -8
    peer.send(peer.headers(3), frame(DATA, 0, 3, grpc_message(b"x")))  # stream 3's: 0
    peer.read()
    peer.send(frame(SETTINGS, 0, 0, setting(INITIAL_WINDOW_SIZE, 4)))  # -4 and 4
    assert [(stream, data) for kind, _, stream, data in peer.read() if kind == DATA] == [
        (3, answer[:4])]
    peer.send(frame(SETTINGS, 0, 0, setting(INITIAL_WINDOW_SIZE, 11)))  # 3 and 7
    assert sorted((stream, data) for kind, _, stream, data in peer.read() if kind == DATA) == [
        (1, answer[8:]), (3, answer[4:])]


def test_window_updates_to_a_waiting_stream_do_not_pile_up() -> None:
    peer = Peer(max_message=100_000)
    peer.start(setting(INITIAL_WINDOW_SIZE, 0))
    peer.send(peer.headers(1), frame(DATA, 0, 1, grpc_message(b"x" * 50_000)))
    peer.send(*[window_update(1, 1)] * 5000)
    frames = peer.read()
    assert [len(data) for kind, _, _, data in frames if kind == DATA] == [1] * 5000
    assert len(peer.connection._waiting_for_stream) < 200  # stale entries are swept


def test_a_window_past_the_maximum_is_a_flow_control_error() -> None:
    peer = Peer()
    peer.start()
    peer.send(peer.headers(1), window_update(1, MAX_WINDOW))  # 1 MiB + 2^31-1: stream error
    assert peer.read() == [(RST_STREAM, 0, 1, FLOW_CONTROL_ERROR.to_bytes(4, "big"))]
    assert peer.log == ["closed"] and not peer.transport.closed
    # Through SETTINGS: the stream's window overflows, found when it next sends.
    peer.send(peer.headers(3), window_update(3, MAX_WINDOW - 65_535),
              frame(SETTINGS, 0, 0, setting(INITIAL_WINDOW_SIZE, 65_536)),
              frame(DATA, 0, 3, grpc_message(b"x")))
    assert goaway_code(peer.read()) == FLOW_CONTROL_ERROR and peer.transport.closed


# --- item 2: bounded streams, buffers and header blocks --------------------------------------


def test_streams_past_the_advertised_limit_are_refused() -> None:
    peer = Peer()
    peer.start()
    peer.send(*(peer.headers(2 * i + 1) for i in range(1000)))
    assert peer.read() == []
    peer.send(peer.headers(2001))
    assert peer.read() == [(RST_STREAM, 0, 2001, REFUSED_STREAM.to_bytes(4, "big"))]
    peer.send(frame(DATA, END_STREAM, 1))  # one call ends: room for one more
    peer.read()
    peer.send(peer.headers(2003), frame(DATA, 0, 2003, grpc_message(b"ok")))
    assert "message ok" in peer.log and peer.connection.open_streams == 1000
    assert (DATA, 0, 2003, grpc_message(b"echo:ok")) in peer.read()


def test_partial_messages_cannot_outgrow_the_connection_buffer() -> None:
    max_message = 1 << 20
    peer = Peer(max_message=max_message)
    peer.start()
    # A prefix claiming a whole max-size message, then 900 KiB of it, on stream after stream.
    partial = b"\x00" + max_message.to_bytes(4, "big") + b"p" * (900 << 10)
    for stream in range(1, 25, 2):
        peer.send(peer.headers(stream), frame(DATA, 0, stream, partial))
        if peer.transport.closed:
            break
    assert goaway_code(peer.read()) == FLOW_CONTROL_ERROR  # the client ignored our window
    assert peer.connection.buffered_bytes <= Http2Limits().buffered_cap(max_message)
    assert not any(entry.startswith("message") for entry in peer.log)


def test_answers_waiting_for_window_are_bounded() -> None:
    """A client that grants no window but keeps sending requests on one stream: each answer
    waits for window, and the connection used to hold them all (18 MB for 18 MB sent)."""
    max_message = 1000
    cap = Http2Limits().parked_cap(max_message)
    peer = Peer(max_message=max_message)
    peer.start(setting(INITIAL_WINDOW_SIZE, 0))
    peer.send(peer.headers(1))
    request = frame(DATA, 0, 1, grpc_message(b"y" * 900))
    most = 0
    for _ in range(2 * cap // 900):
        peer.send(request)
        most = max(most, peer.connection.parked_bytes)
        if peer.transport.closed:
            break
    assert peer.transport.closed
    assert goaway_code(peer.read()) == ENHANCE_YOUR_CALM
    assert most <= cap + len(grpc_message(b"echo:" + b"y" * 900))  # one answer past it
    peer.connection.connection_lost(None)
    assert peer.connection.parked_bytes == 0  # dropped with its stream


def test_a_client_within_its_windows_always_progresses() -> None:
    """Four max-size messages at once fill the buffer cap half-way each: none could complete,
    so the server ends the fullest call (RESOURCE_EXHAUSTED) rather than wait forever."""
    max_message = 1 << 20
    peer = Peer(max_message=max_message)
    peer.start(setting(INITIAL_WINDOW_SIZE, MAX_WINDOW))  # answers are never held back
    peer.send(window_update(0, MAX_WINDOW - 65_535))
    cap = Http2Limits().buffered_cap(max_message)
    message = grpc_message(b"m" * max_message)
    streams = [1, 3, 5, 7]
    peer.send(*(peer.headers(stream) for stream in streams))
    offsets = dict.fromkeys(streams, 0)
    windows = dict.fromkeys(streams, Http2Limits().stream_window)
    connection_window = cap
    ended: dict[int, str] = {}
    for _ in range(1000):
        progressed = False
        for stream in streams:
            room = min(64 << 10, connection_window, windows[stream],
                       len(message) - offsets[stream])
            if stream in ended or room <= 0:
                continue
            chunk = message[offsets[stream]: offsets[stream] + room]
            offsets[stream] += room
            windows[stream] -= room
            connection_window -= room
            peer.send(frame(DATA, 0, stream, chunk))
            assert peer.connection.buffered_bytes <= cap
            progressed = True
        for kind, _, stream, payload in peer.read():
            if kind == WINDOW_UPDATE:
                increment = int.from_bytes(payload, "big")
                if stream == 0:
                    connection_window += increment
                else:
                    windows[stream] += increment
            elif kind == HEADERS and stream in offsets:
                status = peer.header_fields(payload).get("grpc-status")
                if status is not None:
                    ended[stream] = status
            elif kind == DATA:
                ended.setdefault(stream, "answered")
        if not progressed:
            break
    assert set(ended) == set(streams)  # nothing is left waiting
    assert "answered" in ended.values() and "8" in ended.values()
    assert not peer.transport.closed


def test_a_huge_headers_frame_is_refused_before_decoding() -> None:
    """1 MiB of table size updates costs what 32 KiB (also over the 16 KiB limit) does: it is
    never decoded."""
    work = []
    for size in (32 << 10, 1 << 20):
        peer = Peer()
        peer.start()
        work.append(calls(lambda peer=peer, size=size: peer.send(  # type: ignore[misc]
            frame(HEADERS, END_HEADERS, 1, b"\x20" * size))))
        assert goaway_code(peer.read()) == PROTOCOL_ERROR and peer.transport.closed
    assert work[1] <= 1.1 * work[0], work


def test_more_than_two_table_size_updates_are_refused() -> None:
    peer = Peer()
    peer.start()
    peer.send(frame(HEADERS, END_HEADERS, 1, b"\x20\x3f\xe1\x1f\x20" + peer.headers(1)[9:]))
    assert goaway_code(peer.read()) is not None and peer.transport.closed


def test_endless_empty_continuation_frames_are_refused() -> None:
    peer = Peer()
    peer.start()
    peer.send(frame(HEADERS, 0, 1, b""), *[frame(CONTINUATION, 0, 1, b"")] * 500)
    assert goaway_code(peer.read()) == ENHANCE_YOUR_CALM and peer.transport.closed


def test_an_indexed_long_path_gets_a_short_answer() -> None:
    """A 4000-byte non-UTF-8 :path indexed once, then 12-byte header blocks naming it: each
    answer used to echo it percent-encoded (36 KB, over the peer's max frame size)."""
    peer = Peer()
    peer.start()
    encoder = hpack.Encoder()
    path = b"/\xff" * 2000
    first = encoder.encode([(b":method", b"POST"), (b":path", path)])  # indexes :path
    again = encoder.encode([(b":method", b"POST"), (b":path", path)])
    assert len(again) < 12
    peer.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, first))
    peer.read()
    peer.send(*(frame(HEADERS, END_HEADERS | END_STREAM, 2 * i + 3, again) for i in range(100)))
    frames = peer.read()
    assert len(frames) == 100 and all(kind == HEADERS for kind, *_ in frames)
    assert max(len(payload) for *_, payload in frames) < 100
    assert peer.header_fields(frames[0][3])["grpc-message"] == "unknown method"


def test_reading_pauses_while_the_client_does_not_read() -> None:
    class Big(Echo):
        def on_message(self, message: bytes) -> tuple[list[bytes], bool]:
            self.log.append("message")
            return [b"a" * 100_000], False

    peer = Peer(handler=Big)
    peer.start()
    # Enough window for every answer: only back-pressure can stop the server.
    peer.send(frame(SETTINGS, 0, 0, setting(INITIAL_WINDOW_SIZE, MAX_WINDOW)),
              window_update(0, MAX_WINDOW - 65_535))
    peer.send(peer.headers(1), *[frame(DATA, 0, 1, grpc_message(b"q"))] * 100)
    high = Http2Limits().write_high_water
    assert not peer.transport.reading
    assert peer.log.count("message") < 100
    assert len(peer.transport.written) < high + 40 * 100_000  # not all answers were made
    for _ in range(100):
        peer.read()  # the client reads: the server reads (and answers) on
        if peer.transport.reading:
            break
    assert peer.transport.reading and peer.log.count("message") == 100


def test_a_transport_resuming_from_inside_a_write_does_not_reenter_the_frame_loop() -> None:
    class ResumesAtOnce(FakeTransport):
        """Pauses past the high-water mark, then drains at once, inside the same write (as
        asyncio's TLS transport can)."""

        def write(self, data: bytes) -> None:
            super().write(data)
            if self.writing_paused:
                self.drained()

    peer = Peer()
    peer.transport = ResumesAtOnce()
    peer.transport.protocol = peer.connection
    peer.transport.set_write_buffer_limits(100, 0)
    peer.connection._transport = peer.transport  # the greeting went to the first transport
    peer.start()
    peer.send(peer.headers(1), *(frame(DATA, 0, 1, grpc_message(str(n).encode()))
                                 for n in range(300)))
    assert peer.log == [f"message {n}" for n in range(300)]


@pytest.mark.parametrize("wire", [
    frame(SETTINGS, 0, 0) * 1100,
    frame(PING, 0, 0, b"12345678") * 1100,
    frame(PRIORITY, 0, 1, b"\x00\x00\x00\x00\x10") * 1100,
    frame(DATA, 0, 1, b"") * 1100,
], ids=["settings", "ping", "priority", "empty-data"])
def test_control_frame_floods_are_calmed(wire: bytes) -> None:
    peer = Peer()
    peer.start()
    peer.send(peer.headers(1), frame(DATA, END_STREAM, 1, grpc_message(b"a")))
    peer.read()
    peer.send(wire)
    assert goaway_code(peer.read()) == ENHANCE_YOUR_CALM and peer.transport.closed


def test_rapid_reset_is_calmed_but_resets_after_an_answer_are_not() -> None:
    peer = Peer()
    peer.start()
    opening = table_free_headers(peer)
    cancel = (8).to_bytes(4, "big")
    # Envoy resets a call it no longer needs after the picker answered, and half-closes then
    # resets each call once done (the reset finds the call ended here): never limited.
    for first in range(3, 12_000, 400):
        peer.send(*(opening(stream) + frame(DATA, 0, stream, grpc_message(b"a"))
                    + frame(RST_STREAM, 0, stream, cancel)
                    for stream in range(first, first + 200, 2)),
                  *(opening(stream) + frame(DATA, END_STREAM, stream, grpc_message(b"a"))
                    + frame(RST_STREAM, 0, stream, cancel)
                    for stream in range(first + 200, first + 400, 2)))
    assert goaway_code(peer.read()) is None
    # CVE-2023-44487: open and reset at once, before any answer.
    peer.send(*(opening(stream) + frame(RST_STREAM, 0, stream, cancel)
                for stream in range(12_003, 18_003, 2)))
    assert goaway_code(peer.read()) == ENHANCE_YOUR_CALM and peer.transport.closed


@pytest.mark.parametrize(("wire", "code"), [
    (frame(SETTINGS, 1, 0, b"\x00" * 6), FRAME_SIZE_ERROR),  # ACK with a payload
    (frame(RST_STREAM, 0, 0, b"\x00" * 4), PROTOCOL_ERROR),  # on stream 0
    (frame(RST_STREAM, 0, 1, b"\x00" * 3), FRAME_SIZE_ERROR),  # wrong length
    (frame(RST_STREAM, 0, 9, b"\x00" * 4), PROTOCOL_ERROR),  # on an idle stream
    (window_update(9, 1), PROTOCOL_ERROR),  # on an idle stream
], ids=["settings-ack-payload", "rst-stream-0", "rst-size", "rst-idle", "window-update-idle"])
def test_malformed_control_frames_are_connection_errors(wire: bytes, code: int) -> None:
    peer = Peer()
    peer.start()
    peer.send(peer.headers(1))
    peer.send(wire)
    assert goaway_code(peer.read()) == code and peer.transport.closed


def test_token_bucket() -> None:
    now = [0.0]
    bucket = TokenBucket(3, 2.0, clock=lambda: now[0])
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    now[0] += 1.0  # two more
    assert [bucket.take() for _ in range(3)] == [True, True, False]


# --- a real server on loopback: timeouts, throttled logs, the error counter ------------------


async def _server(limits: Http2Limits | None = None,
                  metrics: PickerMetrics | None = None) -> tuple[Http2Server, int]:
    server = Http2Server({PATH: lambda: Echo([])}, 1000, limits=limits,
                         on_error=metrics.count_http2_error if metrics else lambda kind: None)
    return server, await server.start("127.0.0.1", 0)


async def test_slow_handshakes_and_idle_connections_are_closed() -> None:
    server, port = await _server(Http2Limits(preface_timeout=0.3, idle_timeout=0.5))
    try:
        started = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(PREFACE[:10])  # and nothing more
        await asyncio.wait_for(reader.read(), 5.0)  # EOF: closed by the server
        assert 0.25 < time.monotonic() - started < 3.0
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(PREFACE + frame(SETTINGS, 0, 0))
        received = await asyncio.wait_for(reader.read(), 5.0)  # drained, then closed
        assert received.count(bytes((GOAWAY,))) and 0.5 < time.monotonic() - started < 6.0
        writer.close()
    finally:
        await server.stop(0.5)


async def test_protocol_errors_are_counted_and_their_warnings_throttled(
        caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    metrics = PickerMetrics(registry)
    server, port = await _server(metrics=metrics)
    try:
        with caplog.at_level(logging.WARNING, logger="lig.picker.http2"):
            for _ in range(30):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 20)
                await asyncio.wait_for(reader.read(), 5.0)
                writer.close()
        warnings = [r for r in caplog.records if r.name == "lig.picker.http2"]
        assert len(warnings) == 1 and "PROTOCOL_ERROR" in warnings[0].getMessage()
        assert registry.get_sample_value("lig_picker_http2_errors_total",
                                         {"kind": "PROTOCOL_ERROR"}) == 30
    finally:
        await server.stop(0.5)
