"""The JetStream stream that records every snapshot for replay (``LIG_METRICS``).

Snapshots are published with core NATS; the stream captures them server-side and keeps
``max_age`` seconds of history on disk (:mod:`shared.recording` keeps it so).
"""

from __future__ import annotations

import asyncio

from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from shared import recording
from shared.subjects import Subjects


def stream_config(subjects: Subjects, max_age_s: float, replicas: int = 1) -> StreamConfig:
    """File-backed, ``replicas`` copies, oldest messages expire after ``max_age_s``."""
    return recording.recording_config(
        subjects.metrics_stream, subjects.all_metrics(),
        "metric snapshots of every pod, recorded for replay", max_age_s, replicas=replicas)


async def ensure_stream(
    js: JetStreamContext, subjects: Subjects, max_age_s: float, replicas: int = 1
) -> str:
    """Create the stream or align an existing one (:func:`shared.recording.ensure_stream`)."""
    return await recording.ensure_stream(js, stream_config(subjects, max_age_s, replicas))


async def keep_stream(
    js: JetStreamContext,
    subjects: Subjects,
    max_age_s: float,
    stop: asyncio.Event,
    retry_s: float = 1.0,
    replicas: int = 1,
) -> None:
    """Ensure the stream exists, retrying until it does or ``stop`` is set
    (:func:`shared.recording.keep_stream`)."""
    await recording.keep_stream(js, stream_config(subjects, max_age_s, replicas), stop, retry_s)
