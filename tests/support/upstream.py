"""A small real HTTP/1.1 server on loopback standing in for a model server in picker tests.

It answers OpenAI-style requests with a completion that names the ``model`` it received, says
who it is in the ``x-upstream`` header, and streams Server-Sent Events when ``"stream": true``.
It is fast enough to sit behind Envoy in the benchmark (plain asyncio protocol, keep-alive).

Run standalone: ``python -m tests.support.upstream --port 8001 --name pod-a``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading

import msgspec
import uvloop


class _Request(msgspec.Struct):
    model: str | None = None
    stream: bool = False


_decode_request = msgspec.json.Decoder(_Request).decode
_SSE_WORDS = ("Hello", " from", " upstream")


class Received(msgspec.Struct):
    """What one request looked like when it arrived here (for assertions)."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class _Protocol(asyncio.Protocol):
    def __init__(self, server: UpstreamServer) -> None:
        self._server = server
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None

    # typeshed keeps BaseProtocol's BaseTransport here, but a stream protocol is always given a
    # Transport (uvloop's is not a subclass of asyncio.Transport, so isinstance cannot narrow).
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while self._transport is not None:
            request = self._take_request()
            if request is None:
                return
            self._server.handle(request, self._transport)

    def _take_request(self) -> Received | None:
        head_end = self._buffer.find(b"\r\n\r\n")
        if head_end < 0:
            return None
        lines = bytes(self._buffer[:head_end]).decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        start = head_end + 4
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body, end = _dechunk(self._buffer, start)
            if body is None:
                return None
        else:
            end = start + int(headers.get("content-length", "0"))
            if len(self._buffer) < end:
                return None
            body = bytes(self._buffer[start:end])
        del self._buffer[:end]
        return Received(method, path, headers, body)


def _dechunk(buffer: bytearray, pos: int) -> tuple[bytes | None, int]:
    body = bytearray()
    while True:
        line_end = buffer.find(b"\r\n", pos)
        if line_end < 0:
            return None, 0
        size = int(bytes(buffer[pos:line_end]).split(b";")[0], 16)
        chunk_start = line_end + 2
        if size == 0:
            if len(buffer) < chunk_start + 2:
                return None, 0
            return bytes(body), chunk_start + 2
        if len(buffer) < chunk_start + size + 2:
            return None, 0
        body += buffer[chunk_start : chunk_start + size]
        pos = chunk_start + size + 2


class UpstreamServer:
    """One fake model server: ``start()`` in a background thread, ``stop()`` to end it.

    ``name`` is sent back in ``x-upstream``; ``received`` keeps the last requests (bounded) and
    ``count`` how many requests arrived. ``delay`` (seconds, settable) holds every answer back,
    like a model server generating. While ``hold_bodies`` is set, answers send their head at
    once and their body only at :meth:`release_bodies` (a response that takes its time, for as
    long as the test needs).
    """

    def __init__(self, name: str, port: int, host: str = "127.0.0.1", keep: int = 100) -> None:
        self.name = name
        self.host = host
        self.port = port
        self.count = 0
        self.delay = 0.0
        self.hold_bodies = False
        self._held: list[tuple[asyncio.Transport, bytes]] = []
        self.received: list[Received] = []
        self._keep = keep
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        # Who answered: the name, and the ip:port (a gateway emulation reports it as the
        # endpoint that served the request).
        self._name_header = (f"x-upstream: {name}\r\n"
                             f"x-upstream-address: {host}:{port}\r\n").encode()

    @property
    def address(self) -> str:
        """``ip:port`` as the registry and the destination header name it."""
        return f"{self.host}:{self.port}"

    def handle(self, request: Received, transport: asyncio.Transport) -> None:
        """Answer one request on ``transport`` (after ``delay`` seconds)."""
        self.count += 1
        if self._keep:
            self.received.append(request)
            del self.received[: -self._keep]
        answer = self._answer(request)
        if self.hold_bodies:  # the head now, the body when released
            cut = answer.index(b"\r\n\r\n") + 4
            transport.write(answer[:cut])
            self._held.append((transport, answer[cut:]))
        elif self.delay:
            asyncio.get_running_loop().call_later(self.delay, transport.write, answer)
        else:
            transport.write(answer)

    def release_bodies(self) -> None:
        """Stop holding bodies back; send those held so far."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._release)

    def _release(self) -> None:
        self.hold_bodies = False
        held, self._held = self._held, []
        for transport, body in held:
            transport.write(body)

    def _answer(self, request: Received) -> bytes:
        if request.method == "GET":
            body = msgspec.json.encode(
                {"object": "list", "data": [{"id": "served-by-" + self.name, "object": "model"}]}
            )
            return self._head(200, b"application/json", len(body)) + body
        try:
            parsed = _decode_request(request.body)
        except msgspec.DecodeError:
            body = b'{"error": {"message": "upstream got bad JSON"}}'
            return self._head(400, b"application/json", len(body)) + body
        if parsed.stream:
            return self._sse(parsed.model or "")
        body = msgspec.json.encode({
            "id": "cmpl-1",
            "object": "text_completion",
            "model": parsed.model,
            "choices": [{"index": 0, "text": "Hello", "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(request.body) // 4, "completion_tokens": 1,
                      "total_tokens": len(request.body) // 4 + 1},
        })
        return self._head(200, b"application/json", len(body)) + body

    def _head(self, status: int, content_type: bytes, length: int | None) -> bytes:
        reason = b"OK" if status == 200 else b"Error"
        framing = (b"transfer-encoding: chunked\r\n" if length is None
                   else b"content-length: %d\r\n" % length)
        return (b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\n" % (status, reason, content_type)
                + framing + self._name_header + b"\r\n")

    def _sse(self, model: str) -> bytes:
        out = bytearray(self._head(200, b"text/event-stream", None))
        for index, word in enumerate(_SSE_WORDS):
            event: dict[str, object] = {
                "id": "cmpl-1", "object": "text_completion", "model": model,
                "choices": [{"index": 0, "text": word,
                             "finish_reason": "stop" if index == len(_SSE_WORDS) - 1 else None}],
            }
            if index == len(_SSE_WORDS) - 1:
                event["usage"] = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
            out += _chunk(b"data: " + msgspec.json.encode(event) + b"\n\n")
        out += _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        return bytes(out)

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        """Serve on the running loop until ``stop`` is set (forever without one)."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        server = await loop.create_server(lambda: _Protocol(self), self.host, self.port,
                                          reuse_address=True)
        self._ready.set()
        async with server:
            await (stop.wait() if stop is not None else asyncio.Future())

    def start(self) -> UpstreamServer:
        """Serve from a daemon thread; returns once the port accepts connections."""
        def run() -> None:
            loop = asyncio.new_event_loop()
            stop = asyncio.Event()
            self._async_stop = (loop, stop)
            loop.run_until_complete(self.serve(stop))
            loop.close()

        self._thread = threading.Thread(target=run, name=f"upstream-{self.name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"upstream {self.name} did not start")
        return self

    def stop(self) -> None:
        """Stop serving and join the thread."""
        if self._thread is None:
            return
        loop, stop = self._async_stop
        loop.call_soon_threadsafe(stop.set)
        self._thread.join(5)
        self._thread = None


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def main() -> None:
    """Serve one upstream in the foreground (used by the benchmark as a separate process)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="upstream")
    args = parser.parse_args()
    server = UpstreamServer(args.name, args.port, args.host, keep=0)
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(server.serve())


if __name__ == "__main__":
    main()
