"""The NATS configuration the Kubernetes manifests ship, run for real: three nats-server processes
with that file (only addresses and paths moved to loopback and a temporary folder), a certificate
made with the commands docs/nats.md gives, and the users ``lig nats-config`` writes. They form a
cluster over mutual-TLS routes; services connect over TLS with their own users; R3 state works."""

from __future__ import annotations

import asyncio
import re
import shutil
import ssl
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
import yaml
from nats.js.client import KV_STREAM_TEMPLATE

from lig.nats_config import write_config
from lig.server_binaries import server_binary
from services.registry.files import FileSnapshot, SourceFile, load
from services.registry.publisher import Publisher, read_bucket
from shared.subjects import Subjects
from tests.support.nats_server import NatsServer
from tests.support.ports import free_port
from tests.support.registry_yaml import dump, model, pool

KUBERNETES = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "nats.md"
SUBJECTS = Subjects()
NODES = 3


def shipped_config() -> str:
    for document in yaml.safe_load_all((KUBERNETES / "nats.yaml").read_text()):
        if document and document["kind"] == "ConfigMap" and \
                document["metadata"]["name"] == "nats-config":
            return document["data"]["nats.conf"]
    raise AssertionError("no nats-config ConfigMap")


def make_certificate(directory: Path) -> None:
    """Run the openssl commands of docs/nats.md, with 127.0.0.1 added to the names."""
    if shutil.which("openssl") is None:
        raise RuntimeError("the openssl command is needed")
    block = DOCS.read_text().split("cd deploy/kubernetes/nats-secrets")[1].split("```")[0]
    script = re.sub(r"#.*", "", block).replace("DNS:nats,", "IP:127.0.0.1,DNS:nats,")
    directory.mkdir(parents=True)
    subprocess.run(["sh", "-ec", script], cwd=directory, check=True, capture_output=True,
                   timeout=60)


class ShippedNode(NatsServer):
    """A nats-server running the shipped configuration, moved to loopback and ``home``."""

    def __init__(self, index: int, home: Path, tls_dir: Path, auth_dir: Path) -> None:
        super().__init__(home / "data")
        self.index = index
        self.home = home
        self.route_port = free_port()
        self.monitor_port = free_port()
        self.config = home / "config" / "nats.conf"
        self.tls_dir = tls_dir
        self.auth_dir = auth_dir

    def write_config(self, route_ports: list[int]) -> None:
        text = shipped_config()
        replacements = {
            "server_name: $POD_NAME": f"server_name: nats-{self.index}",
            "listen: 0.0.0.0:4222": f"listen: 127.0.0.1:{self.port}",
            "http: 0.0.0.0:8222": f"http: 127.0.0.1:{self.monitor_port}",
            "listen: 0.0.0.0:6222": f"listen: 127.0.0.1:{self.route_port}",
            "store_dir: /data": f"store_dir: {self.store_dir}",
            "/var/run/nats/nats.pid": str(self.home / "nats.pid"),
            "/etc/nats/tls/": f"{self.tls_dir}/",
        }
        for i, port in enumerate(route_ports):
            replacements[f"nats-{i}.nats-cluster.lig.svc.cluster.local:6222"] = f"127.0.0.1:{port}"
        for shipped, here in replacements.items():
            assert shipped in text, shipped
            text = text.replace(shipped, here)
        self.config.parent.mkdir(parents=True)
        self.config.write_text(text)
        # The include is relative to the configuration's folder, as in the pod.
        shutil.copytree(self.auth_dir, self.home / "auth")

    def command(self) -> list[str]:
        # Only the file: its settings may not be given twice.
        return [server_binary("nats-server"), "-c", str(self.config)]


@pytest.fixture
async def shipped_cluster(tmp_path: Path) -> AsyncIterator[tuple[list[ShippedNode], Path]]:
    tls_dir = tmp_path / "tls"
    make_certificate(tls_dir)
    auth_dir = tmp_path / "secrets"
    write_config(auth_dir, SUBJECTS, Subjects("lig-replay"))
    nodes = [ShippedNode(i, tmp_path / f"nats-{i}", tls_dir, auth_dir) for i in range(NODES)]
    for node in nodes:
        node.write_config([peer.route_port for peer in nodes])
    for node in nodes:
        node.start()
    try:
        yield nodes, tmp_path
    finally:
        for node in nodes:
            node.stop()


def credentials(secrets: Path, service: str) -> dict[str, str]:
    lines = (secrets / f"{service}.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line)


async def connect_as(nodes: list[ShippedNode], home: Path, service: str) -> nats.NATS:
    creds = credentials(home / "secrets", service)
    return await nats.connect(
        [node.url for node in nodes], user=creds["LIG_NATS_USER"],
        password=creds["LIG_NATS_PASSWORD"],
        tls=ssl.create_default_context(cafile=str(home / "tls" / "ca.crt")),
        allow_reconnect=False)


async def test_shipped_config_forms_a_tls_cluster_with_per_service_users(
    shipped_cluster: tuple[list[ShippedNode], Path],
) -> None:
    nodes, home = shipped_cluster
    registry = await connect_as(nodes, home, "registry")
    picker = await connect_as(nodes, home, "picker")
    try:
        # R3 needs all three nodes routed to each other (mutual TLS between routes).
        publisher = Publisher(registry.jetstream(timeout=5), SUBJECTS.registry_bucket, replicas=3)
        registry_input = load(FileSnapshot((SourceFile("r.yaml", dump(pool(), model())),)))
        # The JetStream meta leader is elected, and every peer known, in the first seconds.
        deadline = time.monotonic() + 30
        while True:
            try:
                await publisher.publish(registry_input)
                break
            except (nats.errors.Error, TimeoutError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        info = await registry.jetstream().stream_info(
            KV_STREAM_TEMPLATE.format(bucket=SUBJECTS.registry_bucket))
        assert info.config.num_replicas == 3
        assert info.cluster is not None and info.cluster.name == "lig"
        # The picker reads what the registry wrote, and cannot write it.
        assert "endpoints.pool-a" in await read_bucket(picker.jetstream(), SUBJECTS.registry_bucket)
        kv = await picker.jetstream(timeout=1).key_value(SUBJECTS.registry_bucket)
        with pytest.raises((nats.errors.Error, TimeoutError)):
            await kv.put("endpoints.pool-a", b"poisoned")
    finally:
        await registry.close()
        await picker.close()
    # Without TLS, or without a user, the servers do not let a client in.
    creds = credentials(home / "secrets", "picker")
    with pytest.raises((nats.errors.Error, OSError, TimeoutError)):
        await nats.connect(nodes[0].url, user=creds["LIG_NATS_USER"],
                           password=creds["LIG_NATS_PASSWORD"], allow_reconnect=False,
                           connect_timeout=2)
    with pytest.raises((nats.errors.Error, OSError, TimeoutError)):
        await nats.connect(nodes[0].url, allow_reconnect=False, connect_timeout=2,
                           tls=ssl.create_default_context(cafile=str(home / "tls" / "ca.crt")))
