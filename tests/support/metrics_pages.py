"""Real HTTP servers on 127.0.0.1 that serve vLLM metrics pages, for the collector's tests.

Each :class:`PageServer` is one "pod": a threaded HTTP/1.1 (keep-alive) server on its own port
that answers with a fixed page, status and delay, and records every request it gets (time and
User-Agent, which names the scraping collector).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple

import pytest

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "metrics"


def fixture_page(name: str) -> bytes:
    """A page from tests/fixtures/metrics (``vllm_v0.txt``, ``vllm_v1.txt``, ...)."""
    return (FIXTURES / name).read_bytes()


class Request(NamedTuple):
    """One request a page server received."""

    at: float  # time.monotonic()
    user_agent: str
    client_port: int  # tells connections apart: keep-alive reuses one


class PageServer:
    """One HTTP server; ``page``, ``status`` and ``delay_s`` may be changed while it runs."""

    def __init__(self, page: bytes, status: int = 200, delay_s: float = 0.0,
                 path: str | None = None, chunked: bool = False, close: bool = False,
                 stall_body: bool = False) -> None:
        self.page = page
        self.status = status
        self.delay_s = delay_s
        self.path = path  # None: every path serves the page
        self.chunked = chunked  # Transfer-Encoding: chunked instead of Content-Length
        self.close = close  # Connection: close after each response
        # Announce the page's Content-Length, then send no body until stopped: a client that
        # waits for the body shows it by timing out.
        self.stall_body = stall_body
        self._stopped = threading.Event()
        self.requests: list[Request] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                owner.requests.append(Request(time.monotonic(), self.headers["User-Agent"] or "",
                                              self.client_address[1]))
                if owner.delay_s:
                    time.sleep(owner.delay_s)
                status = owner.status if owner.path in (None, self.path) else 404
                body = owner.page if status == 200 else b"error\n"
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                if owner.close:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                if owner.chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for start in range(0, len(body), 7000):
                        chunk = body[start:start + 7000]
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if owner.stall_body:
                        self.wfile.flush()
                        owner._stopped.wait(60)
                        self.close_connection = True
                        return
                    self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: object, client_address: object) -> None:
                pass  # clients that time out and hang up are expected here

        self._server = Server(("127.0.0.1", 0), Handler)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def requests_since(self, since: float) -> list[Request]:
        """Requests received at or after monotonic time ``since``."""
        return [request for request in list(self.requests) if request.at >= since]

    def stop(self) -> None:
        self._stopped.set()
        self._server.shutdown()
        self._server.server_close()


class PageServers:
    """Starts page servers for one test and stops them all afterwards."""

    def __init__(self) -> None:
        self._servers: list[PageServer] = []

    def start(self, page: bytes, status: int = 200, delay_s: float = 0.0,
              path: str | None = None, chunked: bool = False, close: bool = False,
              stall_body: bool = False) -> PageServer:
        server = PageServer(page, status, delay_s, path, chunked, close, stall_body)
        self._servers.append(server)
        return server

    def stop_all(self) -> None:
        for server in self._servers:
            server.stop()


@pytest.fixture
def page_servers() -> Iterator[PageServers]:
    """Start pods with ``page_servers.start(page, status=..., delay_s=..., path=...)``."""
    servers = PageServers()
    try:
        yield servers
    finally:
        servers.stop_all()
