"""The picker's app in the test's own event loop (issue 12): started on free loopback ports
against a real nats-server, asked over real gRPC (health, ext_proc) and HTTP (/metrics), then
stopped through its lifespan, which frees every port and changes nothing process-wide."""

from __future__ import annotations

import asyncio
import gc
import socket
import sys

import grpc
import httpx
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from services.picker.app import serve
from services.picker.settings import PickerSettings
from shared.nats_connection import NatsSettings
from tests.support.fleet_feed import FleetFeed
from tests.support.nats_server import NatsServer
from tests.support.ports import free_port

POOL = "pool-app"
SERVING = health_pb2.HealthCheckResponse.SERVING


def _bindable(port: int) -> bool:
    """True when nothing listens on ``port`` (connections in TIME_WAIT do not count, as for
    any server, which sets SO_REUSEADDR)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def _ready(port: int) -> bool:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
        except grpc.RpcError:
            return False
    return bool(reply.status == SERVING)


async def test_the_picker_app_serves_in_process_and_stops_through_its_lifespan(
        nats_server: NatsServer) -> None:
    feed = FleetFeed(nats_server.url, POOL).start()
    try:
        feed.set_pool()
        feed.set_endpoints({"pod-0": "127.0.0.1:9"})
        feed.set_metrics("pod-0", "127.0.0.1:9", waiting=0, running=1, kv_cache_usage=0.1)
        settings = PickerSettings(pools=[POOL], grpc_port=free_port(), health_port=free_port(),
                                  drain_delay=0.2, nats=NatsSettings(url=nats_server.url))
        metrics_port = free_port()
        switch_interval, frozen = sys.getswitchinterval(), gc.get_freeze_count()
        stop = asyncio.Event()
        app = asyncio.create_task(serve(settings, stop, CollectorRegistry(), metrics_port))

        for _ in range(300):  # up to ~15 s: NATS connection, registry sync, first snapshot
            if app.done() or await _ready(settings.health_port):
                break
            await asyncio.sleep(0.05)
        assert not app.done() and await _ready(settings.health_port)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{settings.grpc_port}") as channel:
            stub = external_processor_pb2_grpc.ExternalProcessorStub(channel)
            call = stub.Process(timeout=5)
            await call.write(pb.ProcessingRequest(
                request_headers=pb.HttpHeaders(end_of_stream=True)))
            answer = await call.read()
            await call.done_writing()
        header = answer.request_headers.response.header_mutation.set_headers[0].header
        assert (header.key, header.raw_value) == ("x-gateway-destination-endpoint",
                                                  b"127.0.0.1:9")
        async with httpx.AsyncClient() as client:
            page = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
        assert 'outcome="routed",pod="pod-0"' in page

        stop.set()
        assert await asyncio.wait_for(app, settings.drain_delay + 5) == 0
        ports = (settings.grpc_port, settings.health_port, metrics_port)
        assert all(_bindable(port) for port in ports), ports
        assert (sys.getswitchinterval(), gc.get_freeze_count()) == (switch_interval, frozen)
    finally:
        feed.stop()
