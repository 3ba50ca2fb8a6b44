"""Putting the requested model name back into responses, and reading usage (pure logic)."""

from __future__ import annotations

import msgspec
import pytest

from services.picker.responses import ResponseRewriter, Usage

COMPLETION = {"id": "c1", "object": "text_completion", "model": "chat-v2",
              "choices": [{"text": "the model said \"model\": \"chat-v2\""}],
              "usage": {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}}


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + msgspec.json.encode(e) + b"\n\n" for e in events) + \
        b"data: [DONE]\n\n"


def test_json_body_gets_the_requested_name_back_and_usage_is_read() -> None:
    rewriter = ResponseRewriter("chat", sse=False)
    out = rewriter.feed(msgspec.json.encode(COMPLETION), end=True)
    assert out is not None
    assert msgspec.json.decode(out) == {**COMPLETION, "model": "chat"}
    assert rewriter.usage == Usage(11, 5)


def test_json_split_over_chunks_is_held_until_the_end() -> None:
    rewriter = ResponseRewriter("chat", sse=False)
    body = msgspec.json.encode(COMPLETION)
    assert rewriter.feed(body[:20], end=False) == b""
    assert rewriter.feed(body[20:50], end=False) == b""
    out = rewriter.feed(body[50:], end=True)
    assert out is not None and msgspec.json.decode(out)["model"] == "chat"


@pytest.mark.parametrize("body", [b"upstream error page", b'{"error": {"message": "x"}}',
                                  b'{"model": "chat"}', b"[1]"])
def test_bodies_without_a_foreign_model_pass_unchanged(body: bytes) -> None:
    assert ResponseRewriter("chat", sse=False).feed(body, end=True) is None


def test_sse_events_are_rewritten_across_chunk_boundaries() -> None:
    events = [{"model": "chat-v2", "choices": [{"text": word}]} for word in ("a", "b", "c")]
    events[-1]["usage"] = {"prompt_tokens": 3, "completion_tokens": 3}
    stream = sse(*events)
    rewriter = ResponseRewriter("chat", sse=True)
    out = b""
    for start in range(0, len(stream), 17):  # chunks cut mid-line
        chunk = stream[start : start + 17]
        piece = rewriter.feed(chunk, end=start + 17 >= len(stream))
        out += chunk if piece is None else piece
    lines = [line for line in out.split(b"\n") if line]
    assert [msgspec.json.decode(line[6:])["model"] for line in lines[:-1]] == ["chat"] * 3
    assert lines[-1] == b"data: [DONE]"
    assert out.count(b"\n\n") == 4  # event framing kept
    assert rewriter.usage == Usage(3, 3)


def test_sse_crlf_lines_keep_their_endings() -> None:
    stream = b'data: {"model":"chat-v2"}\r\n\r\n'
    out = ResponseRewriter("chat", sse=True).feed(stream, end=True)
    assert out == b'data: {"model":"chat"}\r\n\r\n'


def test_read_only_mode_changes_nothing_but_reads_usage() -> None:
    json_reader = ResponseRewriter(None, sse=False)
    assert json_reader.feed(msgspec.json.encode(COMPLETION), end=True) is None
    assert json_reader.usage == Usage(11, 5)
    sse_reader = ResponseRewriter(None, sse=True)
    stream = sse({"model": "x", "usage": {"prompt_tokens": 2, "completion_tokens": 9}})
    assert sse_reader.feed(stream[:10], end=False) is None
    assert sse_reader.feed(stream[10:], end=True) is None
    assert sse_reader.usage == Usage(2, 9)
