"""How many copies of JetStream state (the registry bucket, the recording stream) the cluster
keeps, and keeping existing streams at that count.

One setting for every service (``--nats-replicas``, env ``LIG_NATS_REPLICAS``, default 1).
A KV bucket is the stream ``KV_<bucket>``, so buckets and streams are aligned the same way:
a JetStream stream update with the new ``num_replicas`` (the server adds or removes peers and
copies the data). R1 on a cluster works but loses the state with the node holding it, so the
services say so loudly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import StreamInfo
from nats.js.errors import APIError

from shared import waits
from shared.errors import LigError

log = logging.getLogger("lig.nats")

MAX_REPLICAS = 5  # JetStream's own limit


def cluster_size(server_info: dict[str, Any]) -> int:
    """How many servers the connected server says its cluster has (1 when not clustered).

    A clustered server names its cluster in INFO and lists every member's client URL, its own
    included, in ``connect_urls``.
    """
    if not server_info.get("cluster"):
        return 1
    return max(1, len(server_info.get("connect_urls") or ()))


def replication_warning(server_info: dict[str, Any], replicas: int) -> str | None:
    """The warning to log when ``replicas`` cannot survive the loss of a node, else None."""
    size = cluster_size(server_info)
    if size > 1 and replicas == 1:
        return (f"NATS cluster {server_info.get('cluster')!r} has {size} servers but JetStream "
                "state is kept with 1 replica: losing the node that holds it loses the registry "
                "and the recording; set --nats-replicas 3 (env LIG_NATS_REPLICAS)")
    if replicas > size:
        return (f"--nats-replicas {replicas} but the connected NATS reports {size} server(s): "
                "creating or updating streams will fail until the cluster is that large")
    return None


def warn_about_replication(nc: Client, replicas: int, service: str) -> None:
    """Log :func:`replication_warning` for the connected server, if any."""
    # nats-py keeps the server's INFO only in this attribute (no public accessor).
    warning = replication_warning(dict(nc._server_info), replicas)
    if warning:
        log.warning("%s: %s", service, warning)


class ReplicaAlignmentError(LigError):
    """The stream could not be given the replica count it should have (it keeps its own)."""


async def align_replicas(js: JetStreamContext, stream: str, replicas: int) -> bool:
    """Give an existing stream ``replicas`` copies; True when it had to be updated.

    Raises :class:`ReplicaAlignmentError` with the reason: the server's refusal (e.g. "no
    suitable peers for placement" when the cluster is smaller than ``replicas``) or no answer
    in time (a busy cluster placing peers can answer after the request's timeout). The stream
    then keeps its old count; the caller's next pass tries again.
    """
    try:
        info = await js.stream_info(stream)
        config = info.config
        if (config.num_replicas or 1) == replicas:
            return False
        before = config.num_replicas or 1
        config.num_replicas = replicas
        await js.update_stream(config)
    except (APIError, TimeoutError) as exc:
        raise ReplicaAlignmentError(str(exc) or type(exc).__name__) from exc
    log.info("stream %s: replicas %d -> %d", stream, before, replicas)
    return True


def replica_counts(info: StreamInfo) -> tuple[int, int]:
    """A stream's copies: ``(configured, current)``. Current counts the leader and every
    replica caught up with it; a stream of a server without a cluster has its one copy."""
    configured = info.config.num_replicas or 1
    cluster = info.cluster
    if cluster is None or not cluster.name:
        return configured, 1
    caught_up = sum(1 for peer in cluster.replicas or () if peer.current and not peer.offline)
    return configured, (1 if cluster.leader else 0) + caught_up


async def watch_replicas(js: JetStreamContext, streams: Sequence[str],
                         on_counts: Callable[[str, int, int], None], stop: asyncio.Event,
                         interval_s: float = 5.0) -> None:
    """Every ``interval_s`` until ``stop``: ``on_counts(stream, configured, current)`` for each
    of ``streams`` that answers (one that does not, not yet created or NATS away, is skipped and
    tried again next time)."""
    while not stop.is_set():
        for stream in streams:
            try:
                on_counts(stream, *replica_counts(await js.stream_info(stream)))
            except (NatsError, TimeoutError) as exc:
                log.debug("stream %s: no replica count (%s)", stream, exc)
        await waits.wait_set(stop, interval_s)
