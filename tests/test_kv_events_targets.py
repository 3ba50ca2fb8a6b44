"""Which pods and ranks ``lig kv-events`` subscribes to, on which ports (pure logic)."""

from __future__ import annotations

import pytest

from services.kvevents.targets import PortSpec, Share, parse_port, pods_from_view
from shared.registry_view import RegistryView
from shared.schemas import Endpoint, EndpointSet, InferencePool, encode
from shared.subjects import endpoints_key, pool_key


def view(pods: int) -> RegistryView:
    registry = RegistryView()
    registry.apply(pool_key("pool-a"), encode(InferencePool(name="pool-a", target_port=8000)))
    registry.apply(endpoints_key("pool-a"), encode(EndpointSet(pool="pool-a", endpoints=tuple(
        Endpoint(name=f"pod-{i}", address=f"10.0.0.{i}", port=8000 + i) for i in range(pods)))))
    return registry


def test_ports_absolute_or_relative() -> None:
    assert parse_port("5557", "--events-port") == PortSpec(5557)
    assert parse_port("+1000", "--events-port").port_for(8001) == 9001
    assert parse_port("-443", "--replay-port").port_for(8443) == 8000
    for bad in ("", "x", "0", "70000", "+"):
        with pytest.raises(ValueError, match="--events-port"):
            parse_port(bad, "--events-port")


def test_every_rank_of_every_pod_on_the_ports_plus_its_rank() -> None:
    pods = pods_from_view(view(2), PortSpec(5557), PortSpec(1, relative=True), ranks=range(2))
    assert {(p.pod, p.dp_rank, p.events, p.replay) for p in pods.values()} == {
        ("pod-0", 0, "tcp://10.0.0.0:5557", "tcp://10.0.0.0:8001"),
        ("pod-0", 1, "tcp://10.0.0.0:5558", "tcp://10.0.0.0:8002"),
        ("pod-1", 0, "tcp://10.0.0.1:5557", "tcp://10.0.0.1:8002"),
        ("pod-1", 1, "tcp://10.0.0.1:5558", "tcp://10.0.0.1:8003"),
    }
    no_replay = pods_from_view(view(1), PortSpec(65535), None, ranks=range(2))
    assert [(p.dp_rank, p.replay) for p in no_replay.values()] == [(0, None)]  # 65536: left out


def test_shards_split_pods_and_keep_a_pods_ranks_together() -> None:
    registry = view(40)
    shards = [pods_from_view(registry, PortSpec(5557), None, Share.static(shard, 3), ranks=range(2))
              for shard in range(3)]
    owners: dict[str, int] = {}
    for number, pods in enumerate(shards):
        for pod in pods.values():
            assert owners.setdefault(pod.pod, number) == number
    assert len(owners) == 40 and all(shards)
    assert sum(len(pods) for pods in shards) == 80


def test_replicas_named_by_heartbeats_split_pods_and_a_lone_replica_follows_all() -> None:
    registry = view(30)
    members = frozenset({"kv-a", "kv-b"})
    split = [pods_from_view(registry, PortSpec(5557), None, Share(me, members)) for me in members]
    assert {p.pod for pods in split for p in pods.values()} == {f"pod-{i}" for i in range(30)}
    assert all(split) and sum(len(pods) for pods in split) == 30
    assert len(pods_from_view(registry, PortSpec(5557), None, Share("kv-a",
                                                                     frozenset({"kv-a"})))) == 30
    # When kv-b leaves, kv-a takes its pods and keeps its own.
    mine = pods_from_view(registry, PortSpec(5557), None, Share("kv-a", members))
    alone = pods_from_view(registry, PortSpec(5557), None, Share("kv-a", frozenset()))
    assert set(mine) < set(alone) and len(alone) == 30
