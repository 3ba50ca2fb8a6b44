"""A small HTTP/1.1 server on asyncio streams, enough for OpenAI clients, Envoy and scrapers.

It reads requests with ``Content-Length`` or ``Transfer-Encoding: chunked`` bodies (and answers
``Expect: 100-continue``), keeps connections alive, and writes either whole responses or
streamed ones with chunked transfer encoding (server-sent events). A request it cannot parse
gets a 400 (413 / 431 when too large, 408 when its body stalls) with a JSON body made by the
application, and the connection is closed; the server itself carries on. A handler that raises
gets a 500.

API::

    server = await serve(handler, error_body, host, port)   # an asyncio.Server
    async def handler(request: HttpRequest) -> Response | StreamResponse: ...
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus

from shared.errors import LigError

log = logging.getLogger("lig.sim.http")

MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 32 * 1024 * 1024
BODY_TIMEOUT_S = 30.0
_TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


class HttpRequest:
    """One parsed request. Header names are lower-case; repeated headers are comma-joined."""

    __slots__ = ("body", "headers", "method", "path", "query", "version")

    def __init__(
        self, method: str, target: str, version: str, headers: dict[str, str], body: bytes
    ) -> None:
        self.method = method
        self.path, _, self.query = target.partition("?")
        self.version = version
        self.headers = headers
        self.body = body

    @property
    def keep_alive(self) -> bool:
        """Whether the client lets the connection stay open after the response."""
        connection = self.headers.get("connection", "").lower()
        if self.version == "HTTP/1.0":
            return "keep-alive" in connection
        return "close" not in connection


class Response:
    """A complete response."""

    __slots__ = ("body", "content_type", "status")

    def __init__(
        self, status: int, body: bytes = b"", content_type: str = "application/json"
    ) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type


class StreamResponse:
    """A response whose body is written chunk by chunk as ``chunks`` yields them."""

    __slots__ = ("chunks", "content_type", "status")

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        status: int = 200,
        content_type: str = "text/event-stream; charset=utf-8",
    ) -> None:
        self.status = status
        self.chunks = chunks
        self.content_type = content_type


Handler = Callable[[HttpRequest], Awaitable[Response | StreamResponse]]
ErrorBody = Callable[[int, str], bytes]


class BadRequest(LigError):
    """The bytes on the wire are not a request we accept."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def serve(handler: Handler, error_body: ErrorBody, host: str, port: int) -> asyncio.Server:
    """Listen on ``host:port`` and answer every request with ``handler``."""
    connections = _Connections(handler, error_body)
    return await asyncio.start_server(
        connections.serve, host, port, limit=MAX_HEAD_BYTES, reuse_address=True
    )


class _Connections:
    def __init__(self, handler: Handler, error_body: ErrorBody) -> None:
        self._handler = handler
        self._error_body = error_body

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    request = await _read_request(reader, writer)
                except BadRequest as error:
                    body = self._error_body(error.status, error.message)
                    await _write(writer, Response(error.status, body), keep_alive=False)
                    return
                if request is None:
                    return
                try:
                    response = await self._handler(request)
                except Exception:
                    log.exception("handler failed on %s %s", request.method, request.path)
                    response = Response(500, self._error_body(500, "internal simulator error"))
                keep_alive = request.keep_alive
                if isinstance(response, StreamResponse):
                    done = await _write_stream(writer, response, request.version == "HTTP/1.1")
                    keep_alive = keep_alive and done and request.version == "HTTP/1.1"
                else:
                    await _write(writer, response, keep_alive, head=request.method == "HEAD")
                if not keep_alive:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            return  # the client went away
        except asyncio.CancelledError:
            # The server is shutting down. Python 3.11's stream server logs a cancelled
            # connection task as an error with a traceback; end it quietly instead.
            return
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError, asyncio.CancelledError):
                await writer.wait_closed()


async def _read_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> HttpRequest | None:
    """The next request on the connection, or None when the client closed it cleanly."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise BadRequest(431, "request head too large") from None
    except asyncio.IncompleteReadError as error:
        if error.partial.strip():
            raise BadRequest(400, "incomplete request head") from None
        return None
    lines = head.lstrip(b"\r\n").split(b"\r\n")
    try:
        method, target, version = lines[0].decode("ascii").split(" ")
    except (UnicodeDecodeError, ValueError):
        raise BadRequest(400, "malformed request line") from None
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise BadRequest(400, f"unsupported protocol {version[:20]!r}")
    if not _TOKEN.match(method.encode()) or not target.startswith(("/", "*")):
        raise BadRequest(400, "malformed request line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.match(name):
            raise BadRequest(400, "malformed header line")
        key = name.decode("ascii").lower()
        text = value.strip().decode("latin-1")
        headers[key] = f"{headers[key]},{text}" if key in headers else text
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            body = await _read_body(reader, writer, headers)
    except TimeoutError:
        raise BadRequest(408, "request body not received in time") from None
    return HttpRequest(method, target, version, headers, body)


async def _read_body(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, headers: dict[str, str]
) -> bytes:
    chunked = "transfer-encoding" in headers
    length_text = headers.get("content-length")
    if chunked and length_text is not None:
        raise BadRequest(400, "both Content-Length and Transfer-Encoding")
    if chunked and headers["transfer-encoding"].lower() != "chunked":
        raise BadRequest(400, "only chunked transfer encoding is supported")
    if length_text is not None:
        if not length_text.isdigit():
            raise BadRequest(400, "invalid Content-Length")
        length = int(length_text)
        if length > MAX_BODY_BYTES:
            raise BadRequest(413, "request body too large")
    elif not chunked:
        return b""
    if headers.get("expect", "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    if not chunked:
        return await reader.readexactly(length)
    parts: list[bytes] = []
    size_total = 0
    while True:
        try:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except (ValueError, asyncio.LimitOverrunError):
            raise BadRequest(400, "malformed chunk size") from None
        if size < 0:
            raise BadRequest(400, "malformed chunk size")
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":
                pass  # trailer fields are ignored
            return b"".join(parts)
        size_total += size
        if size_total > MAX_BODY_BYTES:
            raise BadRequest(413, "request body too large")
        parts.append(await reader.readexactly(size))
        if await reader.readexactly(2) != b"\r\n":
            raise BadRequest(400, "malformed chunk")


def _status_line(status: int) -> str:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    return f"HTTP/1.1 {status} {reason}\r\n"


async def _write(
    writer: asyncio.StreamWriter, response: Response, keep_alive: bool, head: bool = False
) -> None:
    connection = "keep-alive" if keep_alive else "close"
    writer.write(
        (
            f"{_status_line(response.status)}content-type: {response.content_type}\r\n"
            f"content-length: {len(response.body)}\r\nconnection: {connection}\r\n"
            "server: lig-sim\r\n\r\n"
        ).encode("latin-1")
        + (b"" if head else response.body)
    )
    await writer.drain()


async def _write_stream(
    writer: asyncio.StreamWriter, response: StreamResponse, chunked: bool
) -> bool:
    """Stream the body; False when the client went away before the end."""
    framing = "transfer-encoding: chunked\r\n" if chunked else "connection: close\r\n"
    writer.write(
        (
            f"{_status_line(response.status)}content-type: {response.content_type}\r\n"
            f"cache-control: no-cache\r\n{framing}server: lig-sim\r\n\r\n"
        ).encode("latin-1")
    )
    chunks = response.chunks
    try:
        async for chunk in chunks:
            if not chunk:
                continue
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
            await writer.drain()
        if chunked:
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        return True
    except (ConnectionError, TimeoutError):
        return False
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
