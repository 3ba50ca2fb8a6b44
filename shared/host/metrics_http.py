"""The Prometheus ``/metrics`` HTTP server every service runs (prometheus-client's own, in a
background thread: scrapes never wait on the event loop)."""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from shared.host.errors import PortInUse


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
            server, thread = start_http_server(port, host, registry)
        except OSError as exc:
            raise PortInUse("metrics", host, port, exc) from None
        return cls(server, thread)

    def stop(self) -> None:
        """Stop serving and close the listening socket (blocks up to ~1 s)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=1)
