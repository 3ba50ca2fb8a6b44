"""Hypothesis-driven frame sequences against the built-in HTTP/2 server, in-process (fake
transport, no network), with small limits so that every limit is reached.

Invariants after every frame: no exception escapes the protocol; buffered message bytes stay
under the connection's cap and open streams under the concurrency limit; what the connection
may be made to hold (receive window, partial messages, parked answers) stays within what it
reserved of a small server-wide budget, and that within the budget; every frame the server
writes parses and fits the client's max frame size; a closed connection sent a GOAWAY first.
After the sequence, a connection still open answers a PING.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import hpack
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from protocols.http2 import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    MAX_FRAME_SIZE,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
)
from protocols.http2_limits import BufferBudget, Http2Limits
from tests.support.http2_peer import Echo, Peer, grpc_message

MAX_MESSAGE = 300

limits_strategy = st.builds(
    lambda streams, window, slack, high: Http2Limits(
        max_concurrent_streams=streams, stream_window=window,
        max_buffered=MAX_MESSAGE + 5 + slack, write_high_water=high, write_low_water=high // 4,
        max_header_block=2048, max_header_list=2048),
    st.integers(1, 6), st.integers(1, 2000), st.integers(0, 3000), st.integers(64, 8192))
# The server-wide budget beyond the default window set aside for every connection: small, so
# that parked answers and window grants run into it.
budget_extra_strategy = st.integers(0, 4000)


class Replies(Echo):
    """Answers every message with a fixed reply (the messages are arbitrary bytes)."""

    def on_message(self, message: bytes) -> tuple[list[bytes], bool]:
        return [b"reply"], False


@dataclass
class Client:
    """What the generated frames need to know about the connection so far."""

    encoder: hpack.Encoder = field(default_factory=hpack.Encoder)
    next_stream: int = 1
    streams: list[int] = field(default_factory=list)


def _rare(draw: st.DrawFn, one_in: int) -> bool:
    """True about once in ``one_in`` draws (a middle value: hypothesis favours the ends)."""
    return draw(st.integers(0, one_in - 1)) == one_in // 2


def _stream(client: Client, draw: st.DrawFn) -> int:
    """An opened stream most of the time, else an arbitrary id (idle, closed, even or 0)."""
    if client.streams and not _rare(draw, 16):
        return client.streams[draw(st.integers(0, len(client.streams) - 1))]
    return draw(st.integers(0, 40))


def _headers(client: Client, draw: st.DrawFn) -> list[bytes]:
    if not _rare(draw, 40):
        stream_id = client.next_stream
        client.next_stream += 2
    else:
        stream_id = draw(st.integers(0, 40))  # maybe reused, even or 0
    path = draw(st.sampled_from([b"/test.Echo/Chat", b"/nope/Method", b"/\xff" * 50]))
    block = client.encoder.encode([(b":method", b"POST"), (b":scheme", b"http"),
                                   (b":path", path), (b"te", b"trailers"),
                                   (b"content-type", b"application/grpc")])
    end_stream = END_STREAM if draw(st.integers(0, 3)) == 0 else 0
    client.streams.append(stream_id)
    split = draw(st.integers(0, len(block)))
    if draw(st.booleans()) or split == len(block):
        flags = END_HEADERS | end_stream
        if draw(st.booleans()):
            return [frame(HEADERS, flags | PADDED | PRIORITY_FLAG, stream_id,
                          b"\x02" + b"\x00\x00\x00\x00\x10" + block + b"pp")]
        return [frame(HEADERS, flags, stream_id, block)]
    return [frame(HEADERS, end_stream, stream_id, block[:split]),
            frame(CONTINUATION, END_HEADERS, stream_id, block[split:])]


def _data(client: Client, draw: st.DrawFn) -> list[bytes]:
    stream_id = _stream(client, draw)
    kind = draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))
    if kind == 0:
        payload = grpc_message(draw(st.binary(max_size=MAX_MESSAGE)))
    elif kind == 1:  # a prefix claiming more than follows (a partial message)
        payload = b"\x00" + draw(st.integers(0, MAX_MESSAGE)).to_bytes(4, "big") + b"p" * draw(
            st.integers(0, MAX_MESSAGE))
    elif kind == 2:  # too large, or compressed
        payload = bytes((draw(st.integers(0, 1)),)) + draw(
            st.integers(MAX_MESSAGE + 1, 2**32 - 1)).to_bytes(4, "big")
    else:
        payload = draw(st.binary(max_size=400))
    flags = END_STREAM if _rare(draw, 4) else 0
    if _rare(draw, 5):
        pad = draw(st.integers(0, 20))
        return [frame(DATA, flags | PADDED, stream_id, bytes((pad,)) + payload + b"\x00" * pad)]
    return [frame(DATA, flags, stream_id, payload)]


def _control(client: Client, draw: st.DrawFn) -> list[bytes]:
    kind = draw(st.sampled_from([0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 6, 6]))
    if kind == 0:
        stream_id = 0 if draw(st.booleans()) else _stream(client, draw)
        increment = draw(st.sampled_from([1, 100, 65_535, 1 << 20] * 4 + [0, 2**31 - 1]))
        return [frame(WINDOW_UPDATE, 0, stream_id, increment.to_bytes(4, "big"))]
    if kind == 1:
        key = draw(st.sampled_from([INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, 0x1, 0x3, 0x42]))
        if key == MAX_FRAME_SIZE:
            values = [16_384, 20_000, 1 << 20]
        else:
            values = [0, 1, 7, 16_384, 65_535, 2**31 - 1]
        value = draw(st.sampled_from(values)) if not _rare(draw, 20) else 2**32 - 1
        return [frame(SETTINGS, 0, 0, key.to_bytes(2, "big") + value.to_bytes(4, "big"))]
    if kind == 2:
        return [frame(PING, draw(st.integers(0, 1)), 0, b"pingpong")]
    if kind == 3:
        stream_id = _stream(client, draw)
        size = draw(st.sampled_from([4] * 15 + [3, 5]))
        return [frame(RST_STREAM, 0, stream_id, draw(st.binary(min_size=size, max_size=size)))]
    if kind == 4:
        if not _rare(draw, 10):
            client.encoder.header_table_size = 0  # acked: the server's table is gone
            return [frame(SETTINGS, 1, 0)]
        return [frame(SETTINGS, 1, 0, b"\x00" * 6)]
    if kind == 5:
        return [frame(GOAWAY, 0, 0, b"\x00" * 8)]
    # Anything but a header block (the generator must know whether one is open).
    raw_kind = draw(st.sampled_from([2, 10, 200] * 5 + [5, 6, 7, 8]))
    return [frame(raw_kind, draw(st.integers(0, 255)), draw(st.integers(0, 2**31 - 1)),
                  draw(st.binary(max_size=30)))]


@st.composite
def frame_sequences(draw: st.DrawFn) -> tuple[Http2Limits, int, list[list[bytes] | None]]:
    """Limits, the budget, and a list of actions: frames to send, or None for "the client
    reads"."""
    limits = draw(limits_strategy)
    budget = draw(budget_extra_strategy)
    client = Client()
    actions: list[list[bytes] | None] = [_headers(client, draw)]
    for _ in range(draw(st.integers(0, 40))):
        choice = draw(st.integers(0, 9))
        if choice < 3:
            actions.append(_headers(client, draw))
        elif choice < 6:
            actions.append(_data(client, draw))
        elif choice < 9:
            actions.append(_control(client, draw))
        else:
            actions.append(None)
    return limits, budget, actions


# No shrinking: a failure is reported at once, with the whole sequence, instead of minutes later.
@settings(max_examples=300, deadline=None, database=None,
          phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(frame_sequences())
def test_frame_sequences_keep_the_server_within_its_limits(
        sequence: tuple[Http2Limits, int, list[list[bytes] | None]]) -> None:
    limits, limit, actions = sequence
    budget = BufferBudget(limit)
    peer = Peer(max_message=MAX_MESSAGE, limits=limits, handler=Replies, budget=budget)
    connection = peer.connection
    peer.send(PREFACE, frame(SETTINGS, 0, 0))  # header blocks decode in the order drawn
    cap = limits.buffered_cap(MAX_MESSAGE)
    max_frame = 16_384
    seen = peer.read()
    for action in actions:
        if action is None:
            seen += peer.read()
            continue
        for wire in action:
            if wire[3] == SETTINGS and wire[9:11] == MAX_FRAME_SIZE.to_bytes(2, "big"):
                value = int.from_bytes(wire[11:15], "big")
                if 16_384 <= value <= 16_777_215:
                    max_frame = max(max_frame, value)
            peer.send(wire)  # an exception escaping here fails the test
            held = sum(len(stream.inbox) for stream in peer.connection._streams.values())
            assert peer.connection.buffered_bytes == held <= cap
            assert peer.connection.open_streams <= limits.max_concurrent_streams
            may_hold = (max(connection._recv_window, 0) + connection.buffered_bytes
                        + connection.parked_bytes)
            if not peer.transport.closed:  # (a closed one returns its part when it is lost)
                assert may_hold <= connection.reserved_bytes == 65_535 + budget.used
                assert budget.used <= limit
            if peer.transport.closed:
                break
        if peer.transport.closed:
            break
    if not peer.transport.closed:
        peer.send(frame(PING, 0, 0, b"lastping"))
        for _ in range(100):  # the client reads until the answer comes (or a GOAWAY)
            seen += peer.read()
            if (PING, ACK, 0, b"lastping") in seen or peer.transport.closed:
                break
    seen += peer.read()
    assert all(len(payload) <= max_frame for *_, payload in seen)
    if peer.transport.closed:  # a GOAWAY went out first (open calls may finish after it)
        assert any(kind == GOAWAY for kind, *_ in seen)
    else:
        assert (PING, ACK, 0, b"lastping") in seen
