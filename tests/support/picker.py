"""Real ``lig picker`` processes on loopback for end-to-end tests and the benchmark.

The fixture ``picker_process`` is a factory: ``picker_process(pool, nats_url, ...)`` starts a
picker subprocess on free ports; every picker it started is stopped after the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from envoy_bootstrap import PickerEndpoint
from tests.support.ports import free_port
from tests.support.processes import die_with_parent


class PickerProcess:
    """One picker subprocess; ``endpoint`` is what Envoy's picker cluster needs. ``pool`` ""
    serves every pool of the registry (no ``--pool``, as ``lig up`` runs pickers)."""

    def __init__(self, pool: str, nats_url: str, workdir: Path, stale_after: float = 1.0,
                 extra_args: tuple[str, ...] = (), log_level: str = "INFO",
                 env: dict[str, str] | None = None) -> None:
        self.pool = pool
        self.env = env or {}  # added to the environment (e.g. PYTHONPATH of an older revision)
        self.nats_url = nats_url
        self.grpc_port = free_port()
        self.health_port = free_port()
        self.metrics_port = free_port()
        self.log_path = workdir / f"picker-{self.grpc_port}.log"
        self.command = [
            sys.executable, "-m", "lig.cli", "picker", *(("--pool", pool) if pool else ()),
            "--host", "127.0.0.1",
            "--grpc-port", str(self.grpc_port), "--health-port", str(self.health_port),
            "--metrics-port", str(self.metrics_port), "--nats-url", nats_url,
            "--stale-after", str(stale_after), "--log-level", log_level, *extra_args,
        ]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> PickerEndpoint:
        """Where Envoy reaches this picker."""
        return PickerEndpoint("127.0.0.1", self.grpc_port, self.health_port)

    @property
    def pid(self) -> int:
        """The process id (for /proc CPU accounting)."""
        assert self.process is not None
        return self.process.pid

    def start(self) -> PickerProcess:
        """Start the process (returns at once; see :meth:`wait_ready`)."""
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1",
                                                 **self.env},
                                            preexec_fn=die_with_parent)
        return self

    def health(self, service: str) -> int | None:
        """The gRPC health status of ``service`` (None when the port does not answer)."""
        with grpc.insecure_channel(f"127.0.0.1:{self.health_port}") as channel:
            try:
                # types-grpcio-health-checking's HealthStub lacks the methods the generated
                # __init__ sets up from the channel.
                reply = health_pb2_grpc.HealthStub(channel).Check(  # type: ignore[attr-defined]
                    health_pb2.HealthCheckRequest(service=service), timeout=1)
            except grpc.RpcError:
                return None
        return reply.status

    def wait_ready(self, timeout: float = 20.0) -> PickerProcess:
        """Block until the readiness service reports SERVING."""
        deadline = time.monotonic() + timeout
        while self.health("readiness") != health_pb2.HealthCheckResponse.SERVING:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"picker exited: {self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"picker not ready: {self.log()[-3000:]}")
            time.sleep(0.05)
        return self

    def metrics(self) -> str:
        """The Prometheus exposition text from ``/metrics``."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.read().decode()

    def log(self) -> str:
        """Everything the process logged so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, number: int) -> None:
        """Send a signal (SIGTERM, SIGKILL, ...)."""
        assert self.process is not None
        self.process.send_signal(number)

    def wait(self, timeout: float) -> int:
        """Wait for the process to exit; its return code."""
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def picker_process(tmp_path: Path) -> Iterator[Callable[..., PickerProcess]]:
    """Factory fixture: ``picker_process(pool, nats_url, **options)`` starts a picker."""
    started: list[PickerProcess] = []

    # ``options`` are PickerProcess's keyword arguments, checked by its signature.
    def factory(pool: str, nats_url: str, **options: Any) -> PickerProcess:
        picker = PickerProcess(pool, nats_url, tmp_path, **options).start()
        started.append(picker)
        return picker

    try:
        yield factory
    finally:
        for picker in started:
            picker.stop()


async def serve_fake_picker(
        servicer: external_processor_pb2_grpc.ExternalProcessorServicer,
) -> tuple[grpc.aio.Server, PickerEndpoint]:
    """An in-test ext_proc ``servicer`` on a free loopback port, its health check SERVING (gRPC
    and health on one port); stop it with ``await server.stop(0)``."""
    server = grpc.aio.server()
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("envoy.service.ext_proc.v3.ExternalProcessor",
                              health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, PickerEndpoint("127.0.0.1", port, port)
