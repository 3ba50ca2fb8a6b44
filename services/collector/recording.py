"""The JetStream stream that records every snapshot for replay (``LIG_METRICS``).

Snapshots are published with core NATS; the stream captures them server-side, so recording
adds nothing to the scrape path. The stream keeps ``max_age`` seconds of history on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from shared.subjects import Subjects

log = logging.getLogger("lig.collector.recording")


def stream_config(subjects: Subjects, max_age_s: float) -> StreamConfig:
    """File-backed, oldest messages expire after ``max_age_s``."""
    return StreamConfig(
        name=subjects.metrics_stream,
        description="metric snapshots of every pod, recorded for replay",
        subjects=[subjects.all_metrics()],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=max_age_s,
    )


async def ensure_stream(js: JetStreamContext, subjects: Subjects, max_age_s: float) -> str:
    """Create the stream, or align an existing one's subjects and max age; returns what it did."""
    wanted = stream_config(subjects, max_age_s)
    try:
        info = await js.stream_info(subjects.metrics_stream)
    except NotFoundError:
        await js.add_stream(wanted)
        return "created"
    current = info.config
    if set(current.subjects or ()) == set(wanted.subjects or ()) and current.max_age == max_age_s:
        return "unchanged"
    current.subjects = wanted.subjects
    current.max_age = max_age_s
    await js.update_stream(current)
    return "updated"


async def keep_stream(
    js: JetStreamContext,
    subjects: Subjects,
    max_age_s: float,
    stop: asyncio.Event,
    retry_s: float = 1.0,
) -> None:
    """Ensure the stream exists, retrying until it does or ``stop`` is set.

    Run again after every reconnect: a restarted server may have lost its store.
    """
    while not stop.is_set():
        try:
            action = await ensure_stream(js, subjects, max_age_s)
        except (NatsError, TimeoutError) as exc:
            log.warning("cannot ensure stream %s yet: %s; retrying", subjects.metrics_stream, exc)
        else:
            log.info("recording snapshots in stream %s (max age %g s): %s",
                     subjects.metrics_stream, max_age_s, action)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), retry_s)
