"""A replica count the cluster cannot give a stream is logged and never stops the service's
work, whether the server refuses it or does not answer in time.

The second case escaped the registry's publisher: only the server's API errors were caught, so
a busy cluster answering a placement after the request's timeout made ``publish()`` raise, on
every pass (``tests/test_nats_replication.py`` failed that way now and then). A slow answer is
not something a real cluster gives on demand, so the JetStream context here is a stand-in
that answers reads and never answers an update in time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import nats.errors
import pytest
from nats.js.api import ClusterInfo, PeerInfo, StreamConfig, StreamInfo, StreamState
from nats.js.errors import BadRequestError

from services.registry.publisher import Publisher
from shared.recording import ensure_stream, recording_config
from shared.replication import ReplicaAlignmentError, align_replicas, replica_counts


@dataclass
class _Info:
    config: StreamConfig


class SlowCluster:
    """Answers stream reads; an update times out (``slow``) or is refused."""

    def __init__(self, config: StreamConfig, slow: bool = True) -> None:
        self.config = config
        self.slow = slow
        self.updates = 0

    async def stream_info(self, name: str) -> _Info:
        assert name == self.config.name
        return _Info(replace(self.config))

    async def update_stream(self, config: StreamConfig) -> None:
        self.updates += 1
        if self.slow:
            raise nats.errors.TimeoutError
        raise BadRequestError(description="insufficient resources")

    async def key_value(self, bucket: str) -> str:
        return f"bucket {bucket}"


RECORDING = recording_config("LIG_METRICS", "lig.metrics.>", "snapshots", 600.0)


@pytest.mark.parametrize("slow", [True, False], ids=["no answer in time", "refused"])
async def test_alignment_fails_with_one_error_for_a_refusal_or_no_answer(slow: bool) -> None:
    cluster = SlowCluster(RECORDING, slow=slow)
    with pytest.raises(ReplicaAlignmentError):
        await align_replicas(cluster, "LIG_METRICS", 3)  # type: ignore[arg-type]
    assert cluster.updates == 1
    assert await align_replicas(cluster, "LIG_METRICS", 1) is False  # nothing to change


async def test_the_registry_opens_its_bucket_when_the_update_times_out(
        caplog: pytest.LogCaptureFixture) -> None:
    cluster = SlowCluster(StreamConfig(name="KV_lig-registry", num_replicas=1))
    publisher = Publisher(cluster, "lig-registry", replicas=5)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="lig.registry.publisher"):
        assert await publisher._open_bucket() == "bucket lig-registry"
    assert cluster.updates == 1
    assert "cannot change to 5 replicas" in caplog.text


async def test_a_recording_stream_keeps_recording_when_the_update_times_out(
        caplog: pytest.LogCaptureFixture) -> None:
    cluster = SlowCluster(RECORDING)
    wanted = replace(RECORDING, num_replicas=3)
    with caplog.at_level(logging.ERROR, logger="lig.recording"):
        assert await ensure_stream(cluster, wanted) == "unchanged"  # type: ignore[arg-type]
    assert "cannot change to 3 replicas, keeping 1" in caplog.text


def _stream(replicas: int, cluster: ClusterInfo | None) -> StreamInfo:
    return StreamInfo(config=StreamConfig(name="s", num_replicas=replicas),
                      state=StreamState(messages=0, bytes=0, first_seq=0, last_seq=0,
                                        consumer_count=0), cluster=cluster)


def test_replica_counts_count_the_leader_and_the_replicas_caught_up() -> None:
    peers = [PeerInfo(name="n2", current=True, offline=False),
             PeerInfo(name="n3", current=False, offline=False),
             PeerInfo(name="n4", current=True, offline=True)]
    assert replica_counts(_stream(3, ClusterInfo(name="c", leader="n1", replicas=peers))) == (3, 2)
    # No leader (an election under way): only the caught-up replica.
    assert replica_counts(_stream(3, ClusterInfo(name="c", leader=None,
                                                 replicas=peers[:1]))) == (3, 1)
    # A single server (no cluster) holds its one copy.
    assert replica_counts(_stream(1, None)) == (1, 1)
    assert replica_counts(_stream(1, ClusterInfo(name=None, leader="n1"))) == (1, 1)
