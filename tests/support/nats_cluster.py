"""A real 3-node NATS cluster for tests: three nats-server processes routed on loopback, each
with JetStream and its own store, so that streams and KV buckets can be replicated (R3) and a
node can be killed and brought back."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.client import Client
from nats.js.api import StorageType, StreamConfig

from tests.support.nats_server import NatsServer
from tests.support.ports import free_port

CLUSTER_NAME = "lig-test"


class ClusterNode(NatsServer):
    """One member of :class:`NatsCluster`; keeps its ports and store across restarts."""

    def __init__(self, name: str, store_dir: Path, extra_args: tuple[str, ...] = ()) -> None:
        super().__init__(store_dir, extra_args=extra_args)
        self.name = name
        self.route_port = free_port()
        self.monitor_port = free_port()
        self.routes: list[str] = []

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def command(self) -> list[str]:
        """The server's flags plus its name, monitoring port and cluster routes."""
        return [*super().command(), "-m", str(self.monitor_port), "--server_name", self.name,
                "--cluster_name", CLUSTER_NAME, "--cluster",
                f"nats://127.0.0.1:{self.route_port}", "--routes", ",".join(self.routes)]

    def client_names(self) -> list[str]:
        """Names of the clients connected to this node now (its monitoring endpoint /connz)."""
        reply = httpx.get(f"http://127.0.0.1:{self.monitor_port}/connz?limit=1000", timeout=2)
        return [conn.get("name", "") for conn in reply.json().get("connections") or ()]

    def kill(self) -> None:
        """SIGKILL: the node vanishes without telling its peers or clients."""
        if self._process is None:
            return
        self._process.send_signal(signal.SIGKILL)
        self._process.wait()
        self._process = None


class NatsCluster:
    """Three routed nodes; ``url`` lists every node's client URL, comma-separated."""

    def __init__(self, base_dir: Path, size: int = 3, extra_args: tuple[str, ...] = ()) -> None:
        self.nodes = [ClusterNode(f"n{i}", base_dir / f"n{i}", extra_args) for i in range(size)]
        for node in self.nodes:
            node.routes = [f"nats://127.0.0.1:{peer.route_port}"
                           for peer in self.nodes if peer is not node]

    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes)

    def node_at(self, port: int) -> ClusterNode:
        """The node whose client port is ``port``."""
        return next(node for node in self.nodes if node.port == port)

    def start(self) -> None:
        for node in self.nodes:
            node.start()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    async def wait_ready(self, within_s: float = 30.0) -> None:
        """Wait until every running node's JetStream answers (its meta leader is elected)."""
        deadline = time.monotonic() + within_s
        for node in self.nodes:
            if not node.running:
                continue
            nc = await nats.connect(node.url, allow_reconnect=False)
            try:
                while not await _jetstream_answers(nc):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"JetStream on {node.name} not ready in {within_s} s")
                    await asyncio.sleep(0.1)
            finally:
                await nc.close()
        # The meta leader answers before it knows every peer: wait until it can place a stream
        # on all of them.
        nc = await nats.connect(self.url.split(","))
        try:
            replicas = sum(1 for node in self.nodes if node.running)
            while not await _can_place(nc, replicas):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cluster cannot place R{replicas} in {within_s} s")
                await asyncio.sleep(0.1)
        finally:
            await nc.close()


async def _jetstream_answers(nc: Client) -> bool:
    try:
        reply = await nc.request("$JS.API.INFO", b"", timeout=0.5)
    except (nats.errors.Error, TimeoutError):
        return False
    return "error" not in json.loads(reply.data)


async def _can_place(nc: Client, replicas: int) -> bool:
    js = nc.jetstream(timeout=2)
    try:
        await js.add_stream(StreamConfig(name="PLACEMENT_PROBE", subjects=["placement.probe"],
                                         storage=StorageType.MEMORY, num_replicas=replicas))
        await js.delete_stream("PLACEMENT_PROBE")
    except (nats.errors.Error, TimeoutError):
        return False
    return True


@pytest.fixture
async def nats_cluster(tmp_path: Path) -> AsyncIterator[NatsCluster]:
    """A fresh 3-node JetStream cluster on loopback, ready for R3 streams."""
    cluster = NatsCluster(tmp_path / "cluster")
    cluster.start()
    try:
        await cluster.wait_ready()
        yield cluster
    finally:
        cluster.stop()
