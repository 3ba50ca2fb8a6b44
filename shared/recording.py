"""JetStream streams that record what a service publishes with core NATS, within age and size
limits.

The services publish with core NATS; a stream captures the messages server-side, so recording
adds nothing to their hot path. The collector records snapshots (``LIG_METRICS``), decisions
and registry changes, ``lig kv-events`` block changes (``LIG_KVBLOCKS``): each keeps such
streams, file-backed, the
oldest messages dropped past ``max_age`` seconds (and ``max_bytes``, when given), in
``replicas`` copies on a cluster (:mod:`shared.replication`). This module creates the stream,
aligns an existing one with the flags, and retries until NATS lets it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig, StreamSource
from nats.js.errors import NotFoundError

from shared.logs import RateLimitedLog
from shared.replication import ReplicaAlignmentError, align_replicas
from shared.waits import wait_set

log = logging.getLogger("lig.recording")


def recording_config(name: str, subject: str | list[str] | None, description: str,
                     max_age_s: float, max_bytes: int | None = None, replicas: int = 1,
                     sources: Sequence[str] = ()) -> StreamConfig:
    """File-backed, ``replicas`` copies, oldest first out past ``max_age_s`` (or ``max_bytes``
    when given; None leaves the size unbounded). It captures ``subject`` (one or a list), or
    (``subject`` None) copies the streams named in ``sources``: JetStream forbids two streams
    with overlapping subjects, so recording another stream's messages means sourcing that
    stream."""
    return StreamConfig(
        name=name,
        description=description,
        subjects=[subject] if isinstance(subject, str) else subject,
        sources=[StreamSource(name=source) for source in sources] or None,
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=max_age_s,
        max_bytes=max_bytes,
        num_replicas=replicas,
    )


async def ensure_stream(js: JetStreamContext, wanted: StreamConfig) -> str:
    """Create the stream, or align an existing one's subjects, limits and replicas; returns
    what it did.

    A replica count the cluster cannot place is logged and the stream keeps recording with its
    old count: recording matters more than the setting.
    """
    name = wanted.name
    if name is None:
        raise ValueError("a recording stream needs a name")
    try:
        info = await js.stream_info(name)
    except NotFoundError:
        await js.add_stream(wanted)
        return "created"
    current = info.config
    action = "unchanged"
    if _limits_differ(current, wanted):
        current.subjects = wanted.subjects
        current.sources = wanted.sources
        current.max_age = wanted.max_age
        if wanted.max_age and (current.duplicate_window or 0) > wanted.max_age:
            # The server sets the window to min(2 min, max age) at creation and refuses a
            # max age below it: shortening the recording would fail on every retry.
            current.duplicate_window = wanted.max_age
        if wanted.max_bytes is not None:
            current.max_bytes = wanted.max_bytes
        await js.update_stream(current)
        action = "updated"
    replicas = wanted.num_replicas or 1
    try:
        if await align_replicas(js, name, replicas):
            action = f"updated to {replicas} replicas"
    except ReplicaAlignmentError as exc:
        log.error("stream %s: cannot change to %d replicas, keeping %d: %s", name, replicas,
                  current.num_replicas or 1, exc)
    return action


def _sources(config: StreamConfig) -> set[str | None]:
    return {source.name for source in config.sources or ()}


def _limits_differ(current: StreamConfig, wanted: StreamConfig) -> bool:
    return (set(current.subjects or ()) != set(wanted.subjects or ())
            or _sources(current) != _sources(wanted)
            or current.max_age != wanted.max_age
            or (wanted.max_bytes is not None and current.max_bytes != wanted.max_bytes))


async def keep_stream(js: JetStreamContext, wanted: StreamConfig, stop: asyncio.Event,
                      retry_s: float = 1.0) -> None:
    """:func:`ensure_stream`, retried until it succeeds or ``stop`` is set (failures logged at
    most every ten seconds).

    Run again after every reconnect: a restarted server may have lost its store.
    """
    failures = RateLimitedLog(log)
    replicas = wanted.num_replicas or 1
    while not stop.is_set():
        try:
            action = await ensure_stream(js, wanted)
        except (NatsError, TimeoutError) as exc:
            failures.warning("cannot ensure stream %s (%d replicas) yet: %s; retrying",
                             wanted.name, replicas, exc)
        else:
            size = f", max {wanted.max_bytes} bytes" if wanted.max_bytes is not None else ""
            log.info("recording stream %s (%s; max age %g s%s, %d replicas): %s",
                     wanted.name, wanted.description, wanted.max_age or 0, size, replicas,
                     action)
            return
        await wait_set(stop, retry_s)


async def keep_streams(js: JetStreamContext, wanted: Sequence[StreamConfig], stop: asyncio.Event,
                       retry_s: float = 1.0) -> None:
    """:func:`keep_stream` for each of ``wanted``, in order."""
    for config in wanted:
        await keep_stream(js, config, stop, retry_s)
