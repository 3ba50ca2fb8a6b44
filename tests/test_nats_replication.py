"""Replicated JetStream state (--nats-replicas): the registry bucket and the recording stream are
created with, and updated to, the configured replica count on a real 3-node cluster; running R1
on a cluster is called out."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.client import Client
from nats.js.client import KV_STREAM_TEMPLATE

from lig import up
from lig.readiness import PROBE_TIMEOUT, _Stack
from lig.up import make_plan
from services.collector.recording import ensure_stream
from services.registry.files import FileSnapshot, SourceFile, load
from services.registry.publisher import Publisher, read_bucket
from shared.errors import ConfigError
from shared.nats_connection import NatsSettings, add_nats_arguments, settings_from_args
from shared.replication import cluster_size, replication_warning, warn_about_replication
from shared.subjects import Subjects
from tests.support.nats_cluster import NatsCluster
from tests.support.ports import LEASES
from tests.support.registry_yaml import dump, model, pool

SUBJECTS = Subjects()
KV_STREAM = KV_STREAM_TEMPLATE.format(bucket=SUBJECTS.registry_bucket)
REGISTRY = load(FileSnapshot((SourceFile("r.yaml", dump(pool(), model())),)))


@pytest.fixture
async def cluster_client(nats_cluster: NatsCluster) -> AsyncIterator[Client]:
    client = await nats.connect(nats_cluster.url.split(","))
    yield client
    await client.close()


async def replicas_of(nc: Client, stream: str, settle_s: float = 5.0) -> tuple[int, int]:
    """(configured replicas, current peers holding a copy) of a stream, once the peers match the
    configuration or ``settle_s`` passed (peers are added and removed after the update returns)."""
    deadline = time.monotonic() + settle_s
    while True:
        info = await nc.jetstream().stream_info(stream)
        configured = info.config.num_replicas or 1
        peers = 1 + sum(1 for peer in (info.cluster.replicas if info.cluster else None) or ()
                        if peer.current)
        if peers == configured or time.monotonic() > deadline:
            return configured, peers
        await asyncio.sleep(0.05)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_nats_arguments(parser)
    return parser.parse_args(argv)


def test_nats_flag_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIG_NATS_URL", raising=False)
    monkeypatch.delenv("LIG_NATS_REPLICAS", raising=False)
    assert settings_from_args(parse([])) == NatsSettings()
    assert NatsSettings().url == "nats://127.0.0.1:4222"


def test_replicas_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIG_NATS_REPLICAS", raising=False)
    assert settings_from_args(parse([])).replicas == 1
    assert settings_from_args(parse(["--nats-replicas", "3"])).replicas == 3
    monkeypatch.setenv("LIG_NATS_REPLICAS", "3")
    assert settings_from_args(parse([])).replicas == 3
    for bad in ("0", "6", "three"):
        with pytest.raises(ConfigError, match="--nats-replicas"):
            settings_from_args(parse(["--nats-replicas", bad]))
    monkeypatch.setenv("LIG_NATS_REPLICAS", "0")
    with pytest.raises(ConfigError, match="LIG_NATS_REPLICAS"):
        settings_from_args(parse([]))


def test_replication_warning_from_server_info() -> None:
    single = {"server_name": "a"}
    cluster = {"cluster": "c", "connect_urls": ["1:1", "2:2", "3:3"]}
    assert cluster_size(single) == 1 and cluster_size(cluster) == 3
    assert replication_warning(single, 1) is None
    assert replication_warning(cluster, 3) is None
    assert "1 replica" in (replication_warning(cluster, 1) or "")
    assert "reports 1 server" in (replication_warning(single, 3) or "")


async def test_r1_on_a_cluster_is_called_out(
    cluster_client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="lig.nats"):
        warn_about_replication(cluster_client, 1, "registry")
        warn_about_replication(cluster_client, 3, "registry")
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "registry" in warnings[0] and "has 3 servers" in warnings[0]


async def test_registry_bucket_is_created_and_updated_to_the_replica_count(
    cluster_client: Client,
) -> None:
    js = cluster_client.jetstream()
    await Publisher(js, SUBJECTS.registry_bucket).publish(REGISTRY)
    assert await replicas_of(cluster_client, KV_STREAM) == (1, 1)

    # A restarted registry with --nats-replicas 3 updates the existing bucket, data included.
    done = await Publisher(js, SUBJECTS.registry_bucket, replicas=3).publish(REGISTRY)
    assert not done.puts and done.unchanged == 3
    assert await replicas_of(cluster_client, KV_STREAM) == (3, 3)
    assert sorted(await read_bucket(js, SUBJECTS.registry_bucket)) == [
        "endpoints.pool-a", "model.pool-a.model-a", "pool.pool-a"]

    await Publisher(js, SUBJECTS.registry_bucket, replicas=1).publish(REGISTRY)
    assert await replicas_of(cluster_client, KV_STREAM) == (1, 1)


async def test_new_registry_bucket_gets_the_replica_count(cluster_client: Client) -> None:
    await Publisher(cluster_client.jetstream(), SUBJECTS.registry_bucket, replicas=3).publish(
        REGISTRY)
    assert await replicas_of(cluster_client, KV_STREAM) == (3, 3)


async def test_unplaceable_replica_count_keeps_publishing(
    cluster_client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    js = cluster_client.jetstream()
    await Publisher(js, SUBJECTS.registry_bucket).publish(REGISTRY)
    with caplog.at_level(logging.WARNING, logger="lig.registry.publisher"):
        done = await Publisher(js, SUBJECTS.registry_bucket, replicas=5).publish(
            load(FileSnapshot((SourceFile("r.yaml", dump(pool(), model(), model("b"))),))))
    assert len(done.puts) == 1
    assert await replicas_of(cluster_client, KV_STREAM) == (1, 1)
    assert any("cannot change to 5 replicas" in r.getMessage() for r in caplog.records)


async def test_recording_stream_is_created_and_updated_to_the_replica_count(
    cluster_client: Client,
) -> None:
    js = cluster_client.jetstream()
    assert await ensure_stream(js, SUBJECTS, 60.0) == "created"
    assert await replicas_of(cluster_client, SUBJECTS.metrics_stream) == (1, 1)
    assert await ensure_stream(js, SUBJECTS, 60.0, replicas=3) == "updated to 3 replicas"
    assert await replicas_of(cluster_client, SUBJECTS.metrics_stream) == (3, 3)
    assert await ensure_stream(js, SUBJECTS, 60.0, replicas=3) == "unchanged"
    # An impossible count is logged and leaves the stream recording as it was.
    assert await ensure_stream(js, SUBJECTS, 60.0, replicas=5) == "unchanged"
    assert await replicas_of(cluster_client, SUBJECTS.metrics_stream) == (3, 3)


async def test_lig_up_registry_probe_waits_while_the_bucket_has_no_leader(
    nats_cluster: NatsCluster, cluster_client: Client, tmp_path: Path
) -> None:
    """``lig up --nats-url CLUSTER`` used to die with a NATS timeout from its registry probe
    when the R3 bucket had no leader yet; the probe now just reports "not ready"."""
    args = argparse.Namespace(**{**vars(up_parser().parse_args([])), "state_dir": tmp_path,
                                 "free_ports": True, "nats_url": nats_cluster.url})
    plan, registry = make_plan(args, LEASES)
    await Publisher(cluster_client.jetstream(), SUBJECTS.registry_bucket, replicas=3).publish(
        registry)
    async with httpx.AsyncClient() as http:
        stack = _Stack(plan, http)
        stack.nc = await nats.connect(nats_cluster.nodes[0].url)
        try:
            assert await stack.registry() is True
            for node in nats_cluster.nodes[1:]:
                node.kill()  # no quorum: the bucket's stream cannot have a leader
            # Whether the last node still answers for a moment or not, the probe returns an answer
            # (no exception) within its timeout, every time.
            for _ in range(3):
                started = time.monotonic()
                assert await stack.registry() in (True, False)
                assert time.monotonic() - started < 2 * PROBE_TIMEOUT + 1
        finally:
            await stack.nc.close()


def up_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    up.configure(parser)
    return parser


async def readable_within(urls: list[str], seconds: float) -> bool:
    """True once the registry bucket can be read from ``urls`` (short requests) in time."""
    nc = await nats.connect(urls, allow_reconnect=False)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            try:
                if await read_bucket(nc.jetstream(timeout=0.5), SUBJECTS.registry_bucket):
                    return True
            except (nats.errors.Error, TimeoutError):
                await asyncio.sleep(0.1)
        return False
    finally:
        await nc.close()


async def kill_the_leader(cluster: NatsCluster, nc: Client) -> list[str]:
    """SIGKILL the node leading the bucket's stream; the survivors' URLs."""
    leader = (await nc.jetstream().stream_info(KV_STREAM)).cluster.leader  # type: ignore[union-attr]
    victim = next(node for node in cluster.nodes if node.name == leader)
    victim.kill()
    return [node.url for node in cluster.nodes if node is not victim]


async def test_the_registry_survives_losing_its_node_with_r3_and_not_with_r1(
    nats_cluster: NatsCluster,
) -> None:
    """The issue's failure: an R1 bucket goes with its node; at R3 the survivors serve it."""
    nc = await nats.connect(nats_cluster.url.split(","))
    try:
        await Publisher(nc.jetstream(), SUBJECTS.registry_bucket).publish(REGISTRY)
        survivors = await kill_the_leader(nats_cluster, nc)
    finally:
        await nc.close()
    assert not await readable_within(survivors, 3.0)

    for node in nats_cluster.nodes:
        if not node.running:
            node.start()
    await nats_cluster.wait_ready()
    nc = await nats.connect(nats_cluster.url.split(","))
    try:
        await Publisher(nc.jetstream(), SUBJECTS.registry_bucket, replicas=3).publish(REGISTRY)
        assert await replicas_of(nc, KV_STREAM, settle_s=10) == (3, 3)
        survivors = await kill_the_leader(nats_cluster, nc)
    finally:
        await nc.close()
    assert await readable_within(survivors, 10.0)
