"""The scraper's HTTP transport against real servers on loopback: keep-alive, chunked bodies,
Connection: close, broken and truncated responses, refused connections, cancellation."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from protocols import http_transport
from protocols.http_transport import KeepAliveTransport, scrape_client
from services.collector.observability import CollectorMetrics
from services.collector.scraper import Scraper
from services.collector.targets import ScrapeTarget
from tests.support.metrics_pages import PageServers, fixture_page
from tests.support.ports import free_port

PAGE = fixture_page("vllm_v1.txt")


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with scrape_client(KeepAliveTransport(), "lig-collector/test") as client:
        yield client


async def raw_server(reply: Callable[[bytes], bytes], hang_up: bool = True) -> asyncio.Server:
    """A server that answers each request head with ``reply(head)`` bytes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        writer.write(reply(head))
        await writer.drain()
        if hang_up:
            writer.close()
        else:
            await asyncio.sleep(10)

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def test_keep_alive_reuses_one_connection_and_sends_the_headers(
    client: httpx.AsyncClient, page_servers: PageServers
) -> None:
    server = page_servers.start(PAGE)
    url = f"http://127.0.0.1:{server.port}/metrics"
    for _ in range(5):
        response = await client.get(url)
        assert response.status_code == 200 and response.content == PAGE
    assert len({request.client_port for request in server.requests}) == 1
    assert {request.user_agent for request in server.requests} == {"lig-collector/test"}


async def test_chunked_and_connection_close_responses(
    client: httpx.AsyncClient, page_servers: PageServers
) -> None:
    chunked = page_servers.start(PAGE, chunked=True)
    closing = page_servers.start(PAGE, close=True)
    for _ in range(3):
        assert (await client.get(f"http://127.0.0.1:{chunked.port}/m")).content == PAGE
        assert (await client.get(f"http://127.0.0.1:{closing.port}/m")).content == PAGE
    assert len({request.client_port for request in chunked.requests}) == 1
    assert len({request.client_port for request in closing.requests}) == 3


async def test_error_status_is_a_response(client: httpx.AsyncClient,
                                          page_servers: PageServers) -> None:
    server = page_servers.start(PAGE, status=503)
    response = await client.get(f"http://127.0.0.1:{server.port}/metrics")
    assert response.status_code == 503


async def test_refused_connection_is_a_connect_error(client: httpx.AsyncClient) -> None:
    with pytest.raises(httpx.ConnectError):
        await client.get(f"http://127.0.0.1:{free_port()}/metrics")


async def test_garbage_and_truncated_responses_are_errors(client: httpx.AsyncClient) -> None:
    garbage = await raw_server(lambda head: b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
    truncated = await raw_server(
        lambda head: b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\nonly this")
    async with garbage, truncated:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get(f"http://127.0.0.1:{garbage.sockets[0].getsockname()[1]}/")
        with pytest.raises(httpx.RemoteProtocolError, match="complete message body"):
            await client.get(f"http://127.0.0.1:{truncated.sockets[0].getsockname()[1]}/")


async def test_a_kept_alive_connection_the_pod_closed_is_retried_once(
    client: httpx.AsyncClient,
) -> None:
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        with contextlib.suppress(asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")  # the next request on this connection: hang up
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        assert (await client.get(url)).content == b"ok"
        assert (await client.get(url)).content == b"ok"
        assert connections == 2


async def test_oversized_page_is_refused(client: httpx.AsyncClient, page_servers: PageServers,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_transport, "MAX_PAGE_BYTES", 10_000)
    server = page_servers.start(PAGE)
    with pytest.raises(httpx.RemoteProtocolError, match="larger than"):
        await client.get(f"http://127.0.0.1:{server.port}/metrics")


async def test_a_cancelled_exchange_drops_its_connection(client: httpx.AsyncClient,
                                                         page_servers: PageServers) -> None:
    server = page_servers.start(PAGE, delay_s=0.5)
    url = f"http://127.0.0.1:{server.port}/metrics"
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):
            await client.get(url)
    server.delay_s = 0
    assert (await client.get(url)).content == PAGE
    assert len({request.client_port for request in server.requests}) == 2


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_50_mb_page_is_reported_too_large_not_as_a_timeout(
    page_servers: PageServers, chunked: bool
) -> None:
    """Issue 13 item 10: the size cap, not the scrape timeout, must explain a huge page.

    An announced size is refused on the response head: the server here announces 50 MB and
    sends no body at all, so a scraper that waited for the body would report a timeout; it
    reports too_large, which holds at any timeout (40 ms by default, where a page server in this
    process, on a loaded machine, missed the deadline now and then). A chunked page must be read
    up to the cap, within a timeout that reading 4 MiB on a loaded machine meets."""
    huge = PAGE * (50 * 1024 * 1024 // len(PAGE) + 1)
    server = page_servers.start(huge, chunked=chunked, stall_body=not chunked)
    metrics = CollectorMetrics()
    scraper = Scraper(10.0, "lig-collector/test", metrics)
    target = ScrapeTarget(pool="main", pod="huge", address=f"127.0.0.1:{server.port}",
                          url=f"http://127.0.0.1:{server.port}/metrics", subject="unused")
    try:
        snapshot = await scraper.scrape(target, seq=1)
        assert not snapshot.ok
        assert (snapshot.error or "").startswith("too large"), snapshot.error
        assert metrics.prometheus.get_sample_value(
            "lig_collector_scrapes_total", {"outcome": "too_large"}) == 1
        assert metrics.prometheus.get_sample_value(
            "lig_collector_scrapes_total", {"outcome": "timeout"}) == 0
        # The oversized exchange dropped its connection; a sane page is then read normally.
        server.page, server.stall_body = PAGE, False
        assert (await scraper.scrape(target, seq=2)).ok
    finally:
        await scraper.aclose()
