"""The built-in HTTP/2 gRPC server: frames in, frames out (fake transport, no network), and
interoperability with a real gRPC client (grpcio) over loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc
import hpack
import pytest

from protocols.http2 import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    MAX_CONCURRENT_STREAMS,
    MAX_WINDOW,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    RESPONSE_HEADERS,
    RST_STREAM,
    SETTINGS,
    TRAILERS_OK,
    WINDOW_UPDATE,
    Http2Connection,
    Http2Server,
    frame,
)
from protocols.http2_limits import Http2Limits
from tests.support.http2_peer import PATH, Echo, FakeTransport, Peer, grpc_message, parse


def test_greeting_settings_and_ping() -> None:
    peer = Peer()
    (settings, window_update) = peer.server_greeting
    assert settings[:3] == (SETTINGS, 0, 0)
    values = {int.from_bytes(settings[3][i: i + 2], "big"):
              int.from_bytes(settings[3][i + 2: i + 6], "big")
              for i in range(0, len(settings[3]), 6)}
    assert values[0x1] == 0  # no dynamic HPACK table, please
    assert values[INITIAL_WINDOW_SIZE] == Http2Limits().stream_window
    assert values[MAX_CONCURRENT_STREAMS] == 1000
    assert values[0x6] == Http2Limits().max_header_list
    assert window_update[:3] == (WINDOW_UPDATE, 0, 0)
    peer.start()
    peer.send(frame(PING, 0, 0, b"12345678"))
    assert peer.read() == [(PING, ACK, 0, b"12345678")]


def test_a_call_with_messages_split_across_frames() -> None:
    peer = Peer()
    peer.start()
    wire = grpc_message(b"first") + grpc_message(b"second")
    peer.send(peer.headers(1), frame(DATA, 0, 1, wire[:3]), frame(DATA, 0, 1, wire[3:14]))
    assert peer.log == ["message first"]
    peer.send(frame(DATA, 0, 1, wire[14:]))
    assert peer.log == ["message first", "message second"]
    frames = peer.read()
    kinds = [(kind, flags, stream) for kind, flags, stream, _ in frames]
    assert kinds == [(HEADERS, END_HEADERS, 1), (DATA, 0, 1), (DATA, 0, 1)]
    assert peer.header_fields(frames[0][3]) == {":status": "200",
                                                "content-type": "application/grpc"}
    assert frames[1][3] == grpc_message(b"echo:first")
    assert frames[2][3] == grpc_message(b"echo:second")
    peer.send(frame(DATA, END_STREAM, 1))  # the client is done: the call ends OK
    (trailer,) = peer.read()
    assert trailer[:3] == (HEADERS, END_HEADERS | END_STREAM, 1)
    assert peer.header_fields(trailer[3]) == {"grpc-status": "0"}
    assert peer.log[-1] == "closed" and peer.log.count("closed") == 1
    assert peer.connection.open_streams == 0


def test_continuation_padding_and_priority_fields() -> None:
    peer = Peer()
    peer.start()
    block = peer.headers(1)[9:]
    padded_block = bytes((3,)) + b"\x00\x00\x00\x00\x10" + block[:5] + b"pad"
    peer.send(frame(HEADERS, PADDED | PRIORITY_FLAG, 1, padded_block),
              frame(CONTINUATION, END_HEADERS, 1, block[5:]),
              frame(DATA, PADDED | END_STREAM, 1, bytes((2,)) + grpc_message(b"hi") + b"xx"))
    assert peer.log == ["message hi", "closed"]
    frames = peer.read()
    assert frames[1][3] == grpc_message(b"echo:hi")
    assert peer.header_fields(frames[2][3]) == {"grpc-status": "0"}


def test_header_blocks_decode_right_before_and_after_the_table_goes() -> None:
    peer = Peer()
    other = b"/test.Other/Method"
    # Before the client acknowledges our SETTINGS it may still index headers.
    peer.send(PREFACE, frame(SETTINGS, 0, 0), peer.headers(1), peer.headers(3, other),
              peer.headers(5))
    assert peer.log == []
    answers = {stream: peer.header_fields(payload) for kind, flags, stream, payload
               in peer.read() if kind == HEADERS}
    assert answers[3]["grpc-status"] == "12"  # unknown method
    assert 1 not in answers and 5 not in answers  # open calls, nothing to say yet
    # After the acknowledgement: a table-size update to 0, then self-contained blocks.
    peer.send(frame(SETTINGS, ACK, 0))
    peer.encoder.header_table_size = 0
    for stream, path in ((7, PATH), (9, other), (11, PATH), (13, other), (15, PATH)):
        peer.send(peer.headers(stream, path), frame(DATA, END_STREAM, stream,
                                                    grpc_message(str(stream).encode())))
    assert [entry for entry in peer.log if entry.startswith("message")] == [
        "message 7", "message 11", "message 15"]


def test_unknown_methods_and_bad_messages_end_only_their_call() -> None:
    peer = Peer(max_message=10)
    peer.start()
    peer.send(peer.headers(1, b"/nope.Service/Method"))
    (answer, reset) = peer.read()
    assert answer[:3] == (HEADERS, END_HEADERS | END_STREAM, 1)
    fields = peer.header_fields(answer[3])
    assert fields == {":status": "200", "content-type": "application/grpc",
                      "grpc-status": "12", "grpc-message": "unknown method"}
    assert reset[:3] == (RST_STREAM, 0, 1)
    peer.send(peer.headers(3), frame(DATA, 0, 3, grpc_message(b"x", compressed=True)))
    peer.send(peer.headers(5), frame(DATA, 0, 5, grpc_message(b"x" * 11)))
    statuses = {stream: peer.header_fields(payload)["grpc-status"]
                for kind, _, stream, payload in peer.read() if kind == HEADERS}
    assert statuses == {3: "12", 5: "8"}
    assert peer.log == ["closed", "closed"]
    peer.send(peer.headers(7), frame(DATA, END_STREAM, 7, grpc_message(b"ok")))
    assert peer.log[-2:] == ["message ok", "closed"]
    assert not peer.transport.closed


def test_a_handler_may_end_the_call_early() -> None:
    peer = Peer(end_after=1)
    peer.start()
    peer.send(peer.headers(1), frame(DATA, 0, 1, grpc_message(b"a") + grpc_message(b"b")))
    assert peer.log == ["message a", "closed"]  # the second message is not delivered
    kinds = [(kind, stream) for kind, _, stream, _ in peer.read()]
    assert kinds == [(HEADERS, 1), (DATA, 1), (HEADERS, 1), (RST_STREAM, 1)]
    peer.send(frame(DATA, END_STREAM, 1, grpc_message(b"late")))  # discarded, no error
    assert peer.read() == [] and not peer.transport.closed


def test_answers_wait_for_flow_control_window() -> None:
    peer = Peer(max_message=100_000)
    peer.start(INITIAL_WINDOW_SIZE.to_bytes(2, "big") + (10).to_bytes(4, "big"))
    payload = b"p" * 40_000
    peer.send(peer.headers(1), frame(DATA, END_STREAM, 1, grpc_message(payload)))
    frames = peer.read()
    assert [(kind, len(data)) for kind, _, _, data in frames] == [
        (HEADERS, len(RESPONSE_HEADERS)), (DATA, 10)]
    peer.send(frame(WINDOW_UPDATE, 0, 1, (50_000).to_bytes(4, "big")))
    frames = peer.read()
    # Frames no larger than the client's (default) 16 KiB maximum, then the trailers.
    assert [(kind, len(data)) for kind, _, _, data in frames] == [
        (DATA, 16_384), (DATA, 16_384), (DATA, 40_010 - 10 - 2 * 16_384),
        (HEADERS, len(TRAILERS_OK))]
    assert frames[-1][1] == END_HEADERS | END_STREAM
    assert peer.log == [f"message {payload.decode()}", "closed"]


def test_client_resets_and_lost_connections_close_the_handlers() -> None:
    peer = Peer()
    peer.start()
    peer.send(peer.headers(1), frame(DATA, 0, 1, grpc_message(b"a")), peer.headers(3))
    peer.send(frame(RST_STREAM, 0, 1, (8).to_bytes(4, "big")))
    assert peer.log == ["message a", "closed"]
    peer.send(frame(DATA, 0, 1, grpc_message(b"late")))  # after the reset: ignored
    assert peer.log == ["message a", "closed"]
    peer.connection.connection_lost(None)
    assert peer.log == ["message a", "closed", "closed"] and peer.lost


def test_drain_lets_open_calls_finish_and_refuses_new_ones() -> None:
    peer = Peer()
    peer.start()
    peer.send(peer.headers(1))
    peer.read()
    peer.connection.drain()
    (first_goaway, ping) = peer.read()
    assert first_goaway[:3] == (GOAWAY, 0, 0)
    assert int.from_bytes(first_goaway[3][:4], "big") == MAX_WINDOW
    peer.send(peer.headers(3))  # opened before the client saw the GOAWAY: still served
    peer.send(frame(PING, ACK, 0, ping[3]))
    (final_goaway,) = peer.read()
    assert int.from_bytes(final_goaway[3][:4], "big") == 3
    peer.send(peer.headers(5))
    assert peer.read() == [(RST_STREAM, 0, 5, (7).to_bytes(4, "big"))]  # REFUSED_STREAM
    peer.send(frame(DATA, END_STREAM, 1), frame(DATA, END_STREAM, 3))
    assert peer.log == ["closed", "closed"]
    assert peer.transport.closed


@pytest.mark.parametrize("wire", [
    b"GET / HTTP/1.1\r\n\r\n" + b"x" * 20,  # not HTTP/2
    PREFACE + frame(DATA, 0, 1, b"x"),  # data on a stream never opened
    PREFACE + frame(HEADERS, END_HEADERS, 2, b""),  # a client must use odd stream ids
    PREFACE + (2 << 20).to_bytes(3, "big") + b"\x00\x00\x00\x00\x00\x01",  # frame too large
    PREFACE + frame(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff"),  # broken HPACK
], ids=["preface", "idle-stream", "even-stream", "frame-size", "hpack"])
def test_protocol_errors_close_the_connection_with_goaway(wire: bytes) -> None:
    peer = Peer()
    peer.send(wire)
    frames = peer.read()
    assert frames[-1][0] == GOAWAY and int.from_bytes(frames[-1][3][4:8], "big") != 0
    assert peer.transport.closed


# --- a real gRPC client (grpcio) against the server on loopback ---------------------------


def _identity(data: bytes) -> bytes:
    return data


@pytest.fixture
async def server() -> AsyncIterator[tuple[Http2Server, int, list[str]]]:
    log: list[str] = []
    built = Http2Server({PATH: lambda: Echo(log)}, max_message=8 << 20)
    port = await built.start("127.0.0.1", 0)
    try:
        yield built, port, log
    finally:
        await built.stop(0.5)


async def test_grpcio_client_interoperates(server: tuple[Http2Server, int, list[str]]) -> None:
    _, port, log = server
    big = b"b" * (3 << 20)  # past every default window and frame size, both ways
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        chat = channel.stream_stream(PATH.decode(), request_serializer=_identity,
                                     response_deserializer=_identity)
        for _ in range(3):  # several calls on one connection
            call = chat()
            await call.write(b"hello")
            assert await call.read() == b"echo:hello"
            await call.write(big)
            assert await call.read() == b"echo:" + big
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
        missing = channel.unary_unary("/nope.Service/Method", request_serializer=_identity,
                                      response_deserializer=_identity)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await missing(b"x")
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert log.count("closed") == 3


async def test_stop_drains_open_calls_within_the_grace(
        server: tuple[Http2Server, int, list[str]]) -> None:
    built, port, log = server
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        chat = channel.stream_stream(PATH.decode(), request_serializer=_identity,
                                     response_deserializer=_identity)
        call = chat()
        await call.write(b"open")
        assert await call.read() == b"echo:open"
        stopping = asyncio.create_task(built.stop(5.0))
        await asyncio.sleep(0.2)
        assert not stopping.done()  # the open call holds the connection
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
        await asyncio.wait_for(stopping, 2.0)
    assert log == ["message open", "closed"]


def test_a_failing_handler_ends_only_its_call() -> None:
    class Broken(Echo):
        def on_message(self, message: bytes) -> tuple[Sequence[bytes], bool]:
            raise RuntimeError("bug")

    log: list[str] = []
    connection = Http2Connection({PATH: lambda: Broken(log)}, 1000)
    transport = FakeTransport()
    connection.connection_made(transport)  # type: ignore[arg-type]
    encoder = hpack.Encoder()
    block = encoder.encode([(":method", "POST"), (":path", PATH)])
    connection.data_received(PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, END_HEADERS, 1, block)
                             + frame(DATA, 0, 1, grpc_message(b"x")))
    trailer = [payload for kind, _, stream, payload in parse(bytes(transport.written))
               if kind == HEADERS and stream == 1][-1]
    assert dict(hpack.Decoder().decode(trailer))["grpc-status"] == "13"
    assert log == ["closed"] and not transport.closed


def test_endless_continuation_is_refused() -> None:
    peer = Peer()
    peer.start()
    peer.send(frame(HEADERS, 0, 1, b""), *[frame(CONTINUATION, 0, 1, b"\x00" * 65_536)] * 5)
    assert peer.read()[-1][0] == GOAWAY and peer.transport.closed
