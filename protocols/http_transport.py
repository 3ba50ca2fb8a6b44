"""The shared HTTP client for scraping, over a lean keep-alive HTTP/1.1 transport.

The scraper uses one ``httpx.AsyncClient``; underneath, :class:`KeepAliveTransport` speaks
HTTP/1.1 with h11 (the protocol engine httpx itself uses) straight on asyncio, keeping one idle
connection per origin. httpx's default transport (httpcore over anyio) spends most of a scrape's
CPU in its pool and cancellation machinery; with this one a whole scrape (fetch, parse, publish)
costs about half the CPU of a bare GET through the default transport (``bench/bench_collector.py``),
which is what lets one collector keep up with 1,000 scrapes a second.

Timeouts are the caller's: the scraper bounds each whole exchange with ``asyncio.timeout``, and a
cancelled exchange closes its connection (a half-read response cannot be reused).
"""

from __future__ import annotations

import asyncio
import ssl

import h11
import httpx

from shared.errors import LigError

# A vLLM metrics page is tens of kilobytes; anything this large is a misconfigured endpoint.
# Small enough that a page streamed without Content-Length reaches it well within a scrape
# timeout on a fast link, so it is reported as too large rather than as a timeout.
MAX_PAGE_BYTES = 4 * 1024 * 1024

Origin = tuple[str, str, int]


class PageTooLarge(LigError, httpx.RemoteProtocolError):
    """The response body is (or announces to be) larger than ``MAX_PAGE_BYTES``."""


def _origin(url: httpx.URL) -> Origin:
    return url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80)


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: h11 state, fed by asyncio's callbacks."""

    def __init__(self) -> None:
        self._h11 = h11.Connection(h11.CLIENT)
        self._transport: asyncio.Transport | None = None
        self._readable: asyncio.Future[None] | None = None
        self._lost = False

    # typeshed keeps BaseProtocol's BaseTransport here, but a stream protocol is always given a
    # Transport (uvloop's is not a subclass of asyncio.Transport, so isinstance cannot narrow).
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._h11.receive_data(data)
        self._wake()

    def eof_received(self) -> bool | None:
        self._h11.receive_data(b"")
        self._wake()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._wake()

    def _wake(self) -> None:
        if self._readable is not None and not self._readable.done():
            self._readable.set_result(None)

    @property
    def reusable(self) -> bool:
        """Idle and open: the last exchange completed cleanly on both sides."""
        return not self._lost and self._h11.our_state is h11.IDLE

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    async def exchange(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` and read its whole response."""
        assert self._transport is not None
        body = request.content
        headers = list(request.headers.raw)
        if body and "content-length" not in request.headers:
            headers.append((b"Content-Length", str(len(body)).encode()))
        out = self._h11.send(h11.Request(method=request.method, target=request.url.raw_path,
                                         headers=headers))
        if body:
            out += self._h11.send(h11.Data(data=body))
        out += self._h11.send(h11.EndOfMessage())
        self._transport.write(out)

        response = await self._next_event()
        while isinstance(response, h11.InformationalResponse):
            response = await self._next_event()
        assert isinstance(response, h11.Response)
        _refuse_announced_oversize(response)
        chunks: list[bytes] = []
        size = 0
        while not isinstance(event := await self._next_event(), h11.EndOfMessage):
            assert isinstance(event, h11.Data)
            size += len(event.data)
            if size > MAX_PAGE_BYTES:
                raise PageTooLarge(f"response larger than {MAX_PAGE_BYTES} bytes")
            chunks.append(event.data)
        if self._h11.their_state is h11.DONE and self._h11.our_state is h11.DONE:
            self._h11.start_next_cycle()  # keep-alive; otherwise the connection is not reused
        return httpx.Response(
            response.status_code,
            headers=response.headers.raw_items(),
            content=b"".join(chunks),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": response.reason},
        )

    async def _next_event(self) -> h11.Event:
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise httpx.RemoteProtocolError(f"bad HTTP response: {exc}") from None
            if isinstance(event, h11.Event):
                return event
            if event is h11.PAUSED:  # h11 holds bytes back that came after the response's end
                raise httpx.RemoteProtocolError("bad HTTP response: data after its end")
            if self._lost:
                raise httpx.ReadError("connection closed before the response was complete")
            self._readable = asyncio.get_running_loop().create_future()
            await self._readable


def _refuse_announced_oversize(response: h11.Response) -> None:
    """Refuse a response whose Content-Length exceeds the cap before reading any of its body.

    Reading it first would take longer than a scrape timeout, which then hides the cause.
    """
    for name, value in response.headers:
        if name == b"content-length" and value.isdigit() and int(value) > MAX_PAGE_BYTES:
            raise PageTooLarge(
                f"response of {int(value)} bytes is larger than {MAX_PAGE_BYTES} bytes")


class KeepAliveTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 with one idle keep-alive connection kept per origin (scheme, host, port).

    A request takes its origin's idle connection (or opens one) for its whole exchange, so
    concurrent requests to one origin simply use separate connections.
    """

    def __init__(self) -> None:
        # Only https origins need it; one context serves them all (loading CAs takes ms).
        self._tls: ssl.SSLContext | None = None
        self._idle: dict[Origin, _Connection] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        origin = _origin(request.url)
        connection = self._idle.pop(origin, None)
        if connection is not None and connection.reusable:
            try:
                return self._keep(origin, connection, await self._exchange(connection, request))
            except httpx.TransportError:
                # The pod may have closed this idle connection just as the request went out
                # (keep-alive timeout); a GET is safe to repeat once on a fresh connection.
                pass
        elif connection is not None:
            connection.close()
        connection = await self._connect(origin)
        return self._keep(origin, connection, await self._exchange(connection, request))

    @staticmethod
    async def _exchange(connection: _Connection, request: httpx.Request) -> httpx.Response:
        try:
            return await connection.exchange(request)
        except BaseException:  # cancelled (timeout) or failed mid-exchange: not reusable
            connection.close()
            raise

    def _keep(self, origin: Origin, connection: _Connection,
              response: httpx.Response) -> httpx.Response:
        """Keep ``connection`` as the origin's idle one if it can be reused."""
        if connection.reusable and origin not in self._idle:
            self._idle[origin] = connection
        else:
            connection.close()
        return response

    async def _connect(self, origin: Origin) -> _Connection:
        scheme, host, port = origin
        tls = None
        if scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            _, connection = await asyncio.get_running_loop().create_connection(
                _Connection, host, port, ssl=tls)
        except OSError as exc:  # refused, unreachable, DNS, TLS handshake (ssl.SSLError)
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from None
        return connection

    def discard(self, url: str) -> None:
        """Close the idle connection to ``url``'s origin (its pod is no longer scraped)."""
        connection = self._idle.pop(_origin(httpx.URL(url)), None)
        if connection is not None:
            connection.close()

    async def aclose(self) -> None:
        for connection in self._idle.values():
            connection.close()
        self._idle.clear()


def scrape_client(transport: KeepAliveTransport, user_agent: str) -> httpx.AsyncClient:
    """The one client a collector scrapes with (time limits are the caller's)."""
    return httpx.AsyncClient(
        transport=transport,
        headers={
            "Accept": "text/plain",
            # Uncompressed: on a cluster network gunzipping 60 KB costs more than it saves.
            "Accept-Encoding": "identity",
            "User-Agent": user_agent,
        },
        trust_env=False,
        follow_redirects=False,
    )
