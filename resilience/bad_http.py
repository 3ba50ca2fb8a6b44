"""Malformed and hostile HTTP/1.1 requests through Envoy (issue 13 items 7 and 8).

Each request is written byte for byte on its own connection (no client library would send
them) and the reply is read raw. Every reply must have a status line and, unless it is a 200,
a JSON body in the OpenAI error shape ``{"error": {"message", "type", "code"}}``; none may be a
5xx, since each case is the client's mistake.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

import msgspec

from resilience.stack import BASE_MODEL, SPLIT_MODEL

READ_TIMEOUT = 10.0
MAX_REPLY = 1 << 20


class Reply(msgspec.Struct):
    """What came back: the status (None: no status line) and the body."""

    status: int | None
    body: bytes = b""
    note: str = ""


def _request(body: bytes, *, version: bytes = b"HTTP/1.1",
             headers: tuple[bytes, ...] = (), chunked_too: bool = False) -> bytes:
    head = [b"POST /v1/completions " + version, b"Host: gateway",
            b"Content-Type: application/json", b"Connection: close",
            b"Content-Length: %d" % len(body), *headers]
    if chunked_too:  # Content-Length and Transfer-Encoding: the smuggling ambiguity
        head.append(b"Transfer-Encoding: chunked")
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def _completion(model: str, **extra: object) -> bytes:
    return json.dumps({"model": model, "prompt": "Say hello", "max_tokens": 2, **extra}).encode()


def _deep_json(depth: int) -> bytes:
    return (b'{"model": "%s", "max_tokens": 2, "prompt": ' % BASE_MODEL.encode()
            + b"[" * depth + b"]" * depth + b"}")


def _huge_body() -> bytes:
    return b'{"model": "%s", "prompt": "' % BASE_MODEL.encode() + b"a" * (33 << 20) + b'"}'


CASES: dict[str, Callable[[], bytes]] = {
    "body not JSON (control)": lambda: _request(b"hello"),
    "HTTP/1.0": lambda: _request(_completion(BASE_MODEL), version=b"HTTP/1.0"),
    "headers over 60 KiB": lambda: _request(_completion(BASE_MODEL),
                                             headers=(b"X-Big: " + b"a" * (62 << 10),)),
    "Content-Length + Transfer-Encoding": lambda: _request(_completion(BASE_MODEL),
                                                           chunked_too=True),
    "2,000 headers": lambda: _request(_completion(BASE_MODEL),
                                      headers=tuple(b"X-H-%d: v" % i for i in range(2000))),
    "JSON nested 5,000 deep": lambda: _request(_deep_json(5000)),
    "1e400 (rewritten model)": lambda: _request(
        b'{"model": "%s", "prompt": "hi", "max_tokens": 1e400}' % SPLIT_MODEL.encode()),
    "invalid UTF-8 (rewritten model)": lambda: _request(
        b'{"model": "%s", "prompt": "\xff\xfe bad", "max_tokens": 2}' % SPLIT_MODEL.encode()),
    "body over 32 MiB": lambda: _request(_huge_body()),
}


async def _read_reply(reader: asyncio.StreamReader) -> Reply:
    head = b""
    with contextlib.suppress(asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
        head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/"):
        return Reply(None, note="no status line" if not head else f"garbage {head[:40]!r}")
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        return Reply(None, note=f"bad status line {lines[0][:40]!r}")
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.partition(":") for line in lines[1:] if line)}
    body = b""
    with contextlib.suppress(asyncio.IncompleteReadError, OSError):
        if "content-length" in headers:
            body = await reader.readexactly(min(int(headers["content-length"]), MAX_REPLY))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            while len(body) < MAX_REPLY:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    break
                body += (await reader.readexactly(size + 2))[:-2]
        else:
            body = await reader.read(MAX_REPLY)
    return Reply(status, body)


async def send(host: str, port: int, raw: bytes) -> Reply:
    """Write ``raw`` on a new connection and read the reply (a peer that hangs up mid-request
    may still have answered: the reply is read either way)."""
    reader, writer = await asyncio.open_connection(host, port, limit=MAX_REPLY)
    try:
        async with asyncio.timeout(READ_TIMEOUT):
            with contextlib.suppress(OSError):
                writer.write(raw)
                await writer.drain()
            return await _read_reply(reader)
    except TimeoutError:
        return Reply(None, note=f"no reply within {READ_TIMEOUT:g} s")
    finally:
        writer.transport.abort()


def openai_error_shape(body: bytes) -> bool:
    """Whether ``body`` is ``{"error": {"message": str, "type": str, "code": ...}}``."""
    try:
        decoded = json.loads(body)
    except ValueError:
        return False
    error = decoded.get("error") if isinstance(decoded, dict) else None
    return (isinstance(error, dict) and isinstance(error.get("message"), str)
            and isinstance(error.get("type"), str) and "code" in error)


def judge(reply: Reply) -> tuple[bool, str]:
    """(passed, what to show): a status, no 5xx, and an OpenAI-shaped error unless a 200."""
    if reply.status is None:
        return False, reply.note
    shaped = reply.status == 200 or openai_error_shape(reply.body)
    code = ""
    if shaped and reply.status != 200:
        code = str(json.loads(reply.body)["error"]["code"])
    shown = f"{reply.status} " + (code or "ok" if shaped else
                                   f"not OpenAI JSON: {reply.body[:40]!r}")
    return shaped and reply.status < 500, shown


async def run_cases(host: str, port: int, names: list[str] | None = None,
                    ) -> list[tuple[str, bool, str, float]]:
    """Send each case (all by default): (name, passed, what came back, seconds)."""
    results = []
    for name, build in CASES.items():
        if names is not None and name not in names:
            continue
        started = time.monotonic()
        passed, shown = judge(await send(host, port, build()))
        results.append((name, passed, shown, time.monotonic() - started))
    return results
