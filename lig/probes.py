"""Health probes of the stack's services, for ``lig up`` and for container healthchecks.

The project image has no curl or grpc_health_probe, so compose and Kubernetes run these probes
through Python::

    python -m lig.probes grpc 127.0.0.1:9003 readiness   # gRPC health of a picker
    python -m lig.probes http http://127.0.0.1:9092/metrics [URL ...]

Each exits 0 when every target is healthy, else 1 with one line saying what is not.
"""

from __future__ import annotations

import asyncio
import sys

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc


async def grpc_serving(target: str, service: str = "readiness", rpc_timeout: float = 1.0
                       ) -> bool:
    """Whether the gRPC health service at ``host:port`` reports ``service`` as SERVING."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            # types-grpcio-health-checking's HealthStub lacks the methods the generated
            # __init__ sets up from the channel.
            reply = await stub.Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(service=service), timeout=rpc_timeout)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def http_ok(client: httpx.AsyncClient, url: str) -> bool:
    """Whether ``url`` answers a GET with a 2xx status."""
    try:
        response = await client.get(url)
    except httpx.HTTPError:
        return False
    return response.is_success


async def _probe(kind: str, targets: list[str]) -> list[str]:
    """The targets that are not healthy."""
    if kind == "grpc":
        address, service = targets[0], targets[1] if len(targets) > 1 else "readiness"
        healthy = await grpc_serving(address, service, rpc_timeout=2.0)
        return [] if healthy else [f"{address} {service}"]
    async with httpx.AsyncClient(timeout=2.0) as client:
        results = await asyncio.gather(*(http_ok(client, url) for url in targets))
    return [url for url, ok in zip(targets, results, strict=True) if not ok]


def main(argv: list[str]) -> int:
    """``python -m lig.probes grpc HOST:PORT [SERVICE]`` or ``... http URL [URL ...]``."""
    if len(argv) < 2 or argv[0] not in ("grpc", "http") or (argv[0] == "grpc" and len(argv) > 3):
        print(__doc__, file=sys.stderr)
        return 2
    failing = asyncio.run(_probe(argv[0], argv[1:]))
    if failing:
        print("not healthy: " + ", ".join(failing), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
