"""The attack tools' pure parts: crafted header blocks decode as intended (checked with the
``hpack`` library, frames with h2's ``hyperframe``), the reply judge, and the figures table."""

from __future__ import annotations

import json

import hpack
import pytest
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
)

from protocols.http2 import Http2Server
from protocols.http2_limits import Http2Limits
from resilience import attacks, h2wire
from resilience.attack import AttackSettings
from resilience.bad_http import Reply, judge, openai_error_shape
from resilience.report import Figure, all_passed, table
from resilience.stack import Picker


@pytest.mark.parametrize("value", [0, 30, 62, 126, 127, 128, 4000, 60_000])
def test_hpack_integers_and_literals_decode_with_the_hpack_library(value: int) -> None:
    header_value = b"v" * value
    decoded = hpack.Decoder().decode(h2wire.literal(b"x-name", header_value), raw=True)
    assert decoded == [(b"x-name", header_value)]


def test_the_amplification_block_indexes_the_path_and_one_byte_refers_to_it() -> None:
    decoder = hpack.Decoder()
    path = b"/" + b"\xff" * 3999
    assert decoder.decode(h2wire.literal(b":path", path, indexed=True), raw=True) == [
        (b":path", path)]
    assert decoder.decode(b"\xbe", raw=True) == [(b":path", path)]  # dynamic index 62


def test_a_request_block_names_the_process_method_without_table_state() -> None:
    decoder = hpack.Decoder()
    headers = dict(decoder.decode(h2wire.request_block(), raw=True))
    assert headers[b":path"] == h2wire.PROCESS_PATH
    assert headers[b":method"] == b"POST" and headers[b"te"] == b"trailers"
    assert not decoder.header_table.dynamic_entries


def test_frames_and_settings_have_the_rfc_layout() -> None:
    assert h2wire.frame(h2wire.PING, h2wire.ACK, 0, b"12345678") == (
        b"\x00\x00\x08\x06\x01\x00\x00\x00\x00" + b"12345678")
    assert h2wire.settings(initial_window_size=0) == (
        b"\x00\x00\x06\x04\x00\x00\x00\x00\x00" + b"\x00\x04\x00\x00\x00\x00")


def test_the_judge_wants_a_status_an_openai_error_and_no_5xx() -> None:
    shaped = json.dumps({"error": {"message": "m", "type": "t", "code": "c"}}).encode()
    assert openai_error_shape(shaped)
    assert not openai_error_shape(b'{"error": "flat"}') and not openai_error_shape(b"Payload")
    assert judge(Reply(400, shaped)) == (True, "400 c")
    assert judge(Reply(200, b"{}")) == (True, "200 ok")
    assert judge(Reply(500, shaped)) == (False, "500 c")
    assert judge(Reply(413, b"Payload Too Large"))[0] is False
    assert judge(Reply(None, note="no status line")) == (False, "no status line")


def test_the_table_aligns_rows_and_marks_targets() -> None:
    figures = [Figure("flood", "ping", "0.10 s", "< 1 s", True),
               Figure("flood", "streams", "10 / 0"),
               Figure("gray-pod", "share", "23%", "< 2%", False)]
    lines = table(figures).splitlines()
    assert lines[0].split() == ["scenario", "figure", "value", "target"]
    assert lines[2].endswith("PASS") and lines[4].endswith("MISS")
    column = lines[0].index("value")
    assert lines[2][column:].startswith("0.10 s") and lines[3][column:] == "10 / 0"
    assert not all_passed(figures) and all_passed(figures[:2])


def test_crafted_frames_parse_as_intended_with_the_h2_stack() -> None:
    """hyperframe (h2's frame layer) reads back what the attacks write."""
    def parse(data: bytes) -> Frame:
        parsed, length = Frame.parse_frame_header(memoryview(data[:9]))
        parsed.parse_body(memoryview(data[9:9 + length]))
        return parsed

    ping = parse(h2wire.frame(h2wire.PING, 0, 0, b"12345678"))
    assert isinstance(ping, PingFrame) and ping.opaque_data == b"12345678"
    window = parse(h2wire.settings(initial_window_size=0, enable_push=0))
    assert isinstance(window, SettingsFrame)
    assert window.settings == {SettingsFrame.INITIAL_WINDOW_SIZE: 0,
                               SettingsFrame.ENABLE_PUSH: 0}
    headers = parse(h2wire.frame(h2wire.HEADERS, h2wire.END_HEADERS, 3, b"\xbe"))
    assert isinstance(headers, HeadersFrame) and headers.stream_id == 3
    assert "END_HEADERS" in headers.flags and headers.data == b"\xbe"
    reset = parse(h2wire.frame(h2wire.RST_STREAM, 0, 5, h2wire.CANCEL.to_bytes(4, "big")))
    assert isinstance(reset, RstStreamFrame) and reset.error_code == 8
    assert isinstance(parse(h2wire.frame(h2wire.CONTINUATION, 0, 1)), ContinuationFrame)
    data = parse(h2wire.frame(h2wire.DATA, 0, 1, h2wire.REQUEST_HEADERS_MESSAGE))
    assert isinstance(data, DataFrame) and data.data[5:] == h2wire.REQUEST_HEADERS_MESSAGE[5:]


def test_slow_connections_are_held_past_the_pickers_preface_timeout() -> None:
    """Held exactly as long as the preface timeout (10 s, the scenario's duration), no slow
    connection was ever seen closed: the attack reported 0/100 against the fixed picker."""
    assert AttackSettings().slow_hold > Http2Limits().preface_timeout


@pytest.mark.process  # a real Http2Server on loopback
async def test_slow_peers_are_each_held_the_whole_wait() -> None:
    """Every slow connection is held ``wait`` seconds, so a server closing them after its
    preface timeout (below ``wait``) is seen closing all of them. (The connections used to be
    opened until the wait was over: the last ones were checked after a fraction of it.)"""
    server = Http2Server({}, 1000, Http2Limits(preface_timeout=0.3))
    port = await server.start("127.0.0.1", 0)
    try:
        result = await attacks.slow_peers(Picker("picker-0", port), 20, 0.8)
    finally:
        await server.stop(0)
    assert (result.idle, result.partial, result.refused) == (20, 20, 0)
    assert (result.idle_closed, result.partial_closed) == (20, 20)
