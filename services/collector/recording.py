"""The JetStream stream that records every snapshot for replay (``LIG_METRICS``).

Snapshots are published with core NATS; the stream captures them server-side, so recording
adds nothing to the scrape path. The stream keeps ``max_age`` seconds of history on disk, in
``replicas`` copies on a cluster (:mod:`shared.replication`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from shared.logs import RateLimitedLog
from shared.replication import align_replicas
from shared.subjects import Subjects

log = logging.getLogger("lig.collector.recording")


def stream_config(subjects: Subjects, max_age_s: float, replicas: int = 1) -> StreamConfig:
    """File-backed, ``replicas`` copies, oldest messages expire after ``max_age_s``."""
    return StreamConfig(
        name=subjects.metrics_stream,
        description="metric snapshots of every pod, recorded for replay",
        subjects=[subjects.all_metrics()],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=max_age_s,
        num_replicas=replicas,
    )


async def ensure_stream(
    js: JetStreamContext, subjects: Subjects, max_age_s: float, replicas: int = 1
) -> str:
    """Create the stream, or align an existing one's subjects, max age and replicas; returns
    what it did.

    A replica count the cluster cannot place is logged and the stream keeps recording with its
    old count: recording matters more than the setting.
    """
    wanted = stream_config(subjects, max_age_s, replicas)
    try:
        info = await js.stream_info(subjects.metrics_stream)
    except NotFoundError:
        await js.add_stream(wanted)
        return "created"
    current = info.config
    action = "unchanged"
    if set(current.subjects or ()) != set(wanted.subjects or ()) or current.max_age != max_age_s:
        current.subjects = wanted.subjects
        current.max_age = max_age_s
        await js.update_stream(current)
        action = "updated"
    try:
        if await align_replicas(js, subjects.metrics_stream, replicas):
            action = f"updated to {replicas} replicas"
    except APIError as exc:
        log.error("stream %s: cannot change to %d replicas, keeping %d: %s",
                  subjects.metrics_stream, replicas, current.num_replicas or 1, exc)
    return action


async def keep_stream(
    js: JetStreamContext,
    subjects: Subjects,
    max_age_s: float,
    stop: asyncio.Event,
    retry_s: float = 1.0,
    replicas: int = 1,
) -> None:
    """Ensure the stream exists, retrying until it does or ``stop`` is set.

    Run again after every reconnect: a restarted server may have lost its store.
    """
    failures = RateLimitedLog(log)
    while not stop.is_set():
        try:
            action = await ensure_stream(js, subjects, max_age_s, replicas)
        except (NatsError, TimeoutError) as exc:
            failures.warning("cannot ensure stream %s (%d replicas) yet: %s; retrying",
                             subjects.metrics_stream, replicas, exc)
        else:
            log.info("recording snapshots in stream %s (max age %g s, %d replicas): %s",
                     subjects.metrics_stream, max_age_s, replicas, action)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), retry_s)
