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


# prompt_tokens_details as vLLM sends it: the whole object in a body, only the set fields in a
# stream's usage chunk, null without --enable-prompt-tokens-details (or absent, as other servers).
DETAILS = {"cached_tokens": 48, "created_cache_tokens": None, "multimodal_tokens": None}


def usage_of(details: object, *, absent: bool = False) -> dict[str, object]:
    usage: dict[str, object] = {"prompt_tokens": 64, "completion_tokens": 7, "total_tokens": 71}
    if not absent:
        usage["prompt_tokens_details"] = details
    return usage


def read(requested: str | None, sse_mode: bool, usage: dict[str, object]) -> Usage | None:
    """The usage a rewriter reads from a response carrying ``usage`` (chunks cut mid-line)."""
    if sse_mode:
        body = sse({"model": "chat-v2", "choices": [{"text": "a"}], "usage": None},
                   {"model": "chat-v2", "choices": [], "usage": usage})
    else:
        body = msgspec.json.encode({**COMPLETION, "usage": usage})
    rewriter = ResponseRewriter(requested, sse_mode)
    for start in range(0, len(body), 23):
        rewriter.feed(body[start : start + 23], end=start + 23 >= len(body))
    return rewriter.usage


PATHS = pytest.mark.parametrize(("requested", "sse_mode"), [
    (None, False), (None, True), ("chat", False), ("chat", True)],
    ids=["json-read", "sse-read", "json-rewrite", "sse-rewrite"])


@PATHS
@pytest.mark.parametrize("details", [DETAILS, {"cached_tokens": 48}], ids=["body", "stream"])
def test_cached_tokens_are_read_from_the_prompt_tokens_details(
        requested: str | None, sse_mode: bool, details: object) -> None:
    assert read(requested, sse_mode, usage_of(details)) == Usage(64, 7, 48)


@PATHS
def test_zero_cached_tokens_is_a_report_not_a_missing_one(requested: str | None,
                                                          sse_mode: bool) -> None:
    assert read(requested, sse_mode, usage_of({"cached_tokens": 0})) == Usage(64, 7, 0)


@PATHS
@pytest.mark.parametrize("details", [
    None, {}, {"cached_tokens": None}, {"cached_tokens": "48"}, {"cached_tokens": True},
    {"cached_tokens": -1}, {"cached_tokens": 4.5}, [48], "absent"])
def test_details_without_a_cached_count_keep_the_token_counts(
        requested: str | None, sse_mode: bool, details: object) -> None:
    usage = usage_of(None, absent=True) if details == "absent" else usage_of(details)
    assert read(requested, sse_mode, usage) == Usage(64, 7, None)
