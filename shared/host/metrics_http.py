"""The Prometheus ``/metrics`` HTTP server every service runs (prometheus-client's own, in a
background thread: scrapes never wait on the event loop)."""

from __future__ import annotations

import socket
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from shared.host.errors import PortInUse

SHUTDOWN_POLL_S = 0.05  # how often the serving thread checks for a stop


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        """Drop the line."""


class _MetricsServer4(ThreadingWSGIServer):
    """The HTTP server on an IPv4 address."""


class _MetricsServer6(ThreadingWSGIServer):
    """The HTTP server on an IPv6 address."""

    address_family = socket.AF_INET6


class MetricsServer:
    """A running ``/metrics`` server; :meth:`stop` shuts it down and frees the port."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread

    @property
    def port(self) -> int:
        """The bound port (useful when started on port 0)."""
        return int(self._server.server_address[1])

    @classmethod
    def start(cls, host: str, port: int, registry: CollectorRegistry) -> MetricsServer:
        """Start serving; :class:`PortInUse` when ``host:port`` cannot be bound."""
        try:
            family, _, _, _, address = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            server_type = _MetricsServer6 if family == socket.AF_INET6 else _MetricsServer4
            server: WSGIServer = make_server(str(address[0]), port, make_wsgi_app(registry),
                                             server_type, handler_class=_QuietHandler)
        except OSError as exc:
            raise PortInUse("metrics", host, port, exc) from None
        # prometheus-client's own start_http_server polls for shutdown every 0.5 s, which
        # every service's stop would wait out.
        thread = threading.Thread(target=server.serve_forever, args=(SHUTDOWN_POLL_S,),
                                  name="metrics-http", daemon=True)
        thread.start()
        return cls(server, thread)

    def stop(self) -> None:
        """Stop serving and close the listening socket (blocks up to ~1 s)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=1)
