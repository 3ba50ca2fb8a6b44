"""gRPC health (``grpc.health.v1.Health``) for probes and Envoy's active health checks.

Services: ``liveness`` (serving while the process runs), ``readiness`` and
``envoy.service.ext_proc.v3.ExternalProcessor`` (serving once registry state and a metric
snapshot have arrived; readiness is kept through a later NATS outage, during which the picker
goes on serving from its last state). The empty service name mirrors readiness.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

LIVENESS = "liveness"
READINESS = "readiness"
EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"
_READY_SERVICES = ("", READINESS, EXT_PROC)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class PickerHealth:
    """The health server on its own port, with the picker's three services."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server
        self._servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        self.ready = False

    async def start(self) -> None:
        """Serve: live, not yet ready."""
        await self._servicer.set(LIVENESS, SERVING)
        for service in _READY_SERVICES:
            await self._servicer.set(service, NOT_SERVING)
        await self._server.start()

    async def set_ready(self) -> None:
        """Report ready (idempotent)."""
        if self.ready:
            return
        self.ready = True
        for service in _READY_SERVICES:
            await self._servicer.set(service, SERVING)

    async def stop(self, grace: float) -> None:
        """Report NOT_SERVING everywhere, then stop within ``grace`` seconds."""
        await self._servicer.enter_graceful_shutdown()
        await self._server.stop(grace)
