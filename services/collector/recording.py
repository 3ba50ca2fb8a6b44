"""The JetStream streams that record the fleet for replay and export (``lig record``).

Three streams, all file-backed, in ``replicas`` copies on a cluster (:mod:`shared.replication`),
each with an age and a size limit (the oldest messages go first):

- ``LIG_METRICS`` over ``<prefix>.metrics.>``: every snapshot;
- ``LIG_DECISIONS`` over ``<prefix>.decisions.*`` and ``<prefix>.records.*``: what the pickers
  publish on the decision stream, and their decision records (the flight recorder);
- ``LIG_REGISTRY``: every registry change, *sourced* from the registry bucket's stream
  ``KV_<prefix>-registry``. JetStream forbids two streams with overlapping subjects, so the
  recording cannot listen on ``$KV.<bucket>.>`` itself; a source copies the bucket's messages
  (subject, headers, body) with their origin sequence in the ``Nats-Stream-Source`` header.
  The bucket keeps only the last few revisions per key and no age limit; this stream keeps
  every change for the recording's age.

Snapshots and decisions are published with core NATS; the streams capture them server-side, so
recording adds nothing to the scrape or the request path. The collector creates and maintains
all three (:mod:`shared.recording`): it is the one service that already manages JetStream state
for recording, and it keeps the pickers (many replicas, on the request path) free of stream
administration.
"""

from __future__ import annotations

import asyncio

import msgspec
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from shared import recording
from shared.subjects import Subjects

GIB = 1 << 30
METRICS_MAX_BYTES = 2 * GIB  # two hours of the ~1 GB/hour 1,000 snapshots/s produce
DECISIONS_MAX_BYTES = 1 * GIB
REGISTRY_MAX_BYTES = 64 << 20  # registry changes are rare and small


class StreamBytes(msgspec.Struct, frozen=True):
    """Size limit, in bytes, of each recording stream."""

    metrics: int = METRICS_MAX_BYTES
    decisions: int = DECISIONS_MAX_BYTES
    registry: int = REGISTRY_MAX_BYTES


DEFAULT_BYTES = StreamBytes()


def registry_source(subjects: Subjects) -> str:
    """The stream behind the registry bucket, which the registry recording sources."""
    return f"KV_{subjects.registry_bucket}"


def stream_config(subjects: Subjects, max_age_s: float, replicas: int = 1,
                  max_bytes: int = METRICS_MAX_BYTES) -> StreamConfig:
    """The snapshot recording: oldest messages expire after ``max_age_s`` or ``max_bytes``."""
    return recording.recording_config(
        subjects.metrics_stream, subjects.all_metrics(),
        "metric snapshots of every pod, recorded for replay", max_age_s, max_bytes, replicas)


def recording_configs(subjects: Subjects, max_age_s: float, replicas: int = 1,
                      max_bytes: StreamBytes = DEFAULT_BYTES) -> list[StreamConfig]:
    """The three recording streams (metrics, decisions, registry)."""
    return [
        stream_config(subjects, max_age_s, replicas, max_bytes.metrics),
        recording.recording_config(
            subjects.decisions_stream, [subjects.all_decisions(), subjects.all_records()],
            "the pickers' decisions and decision records, recorded for replay", max_age_s,
            max_bytes.decisions, replicas),
        recording.recording_config(
            subjects.registry_stream, None, "every registry change, recorded for replay",
            max_age_s, max_bytes.registry, replicas, sources=[registry_source(subjects)]),
    ]


async def ensure_stream(js: JetStreamContext, subjects: Subjects, max_age_s: float,
                        replicas: int = 1, max_bytes: int = METRICS_MAX_BYTES) -> str:
    """Create or align the snapshot recording stream alone; returns what it did."""
    return await recording.ensure_stream(
        js, stream_config(subjects, max_age_s, replicas, max_bytes))


async def ensure_recording(js: JetStreamContext, subjects: Subjects, max_age_s: float,
                           replicas: int = 1, max_bytes: StreamBytes = DEFAULT_BYTES
                           ) -> dict[str, str]:
    """Create or align every recording stream; what was done, by stream name."""
    return {str(config.name): await recording.ensure_stream(js, config)
            for config in recording_configs(subjects, max_age_s, replicas, max_bytes)}


async def keep_stream(js: JetStreamContext, subjects: Subjects, max_age_s: float,
                      stop: asyncio.Event, retry_s: float = 1.0, replicas: int = 1,
                      max_bytes: StreamBytes = DEFAULT_BYTES) -> None:
    """Ensure the recording streams exist, each retried until it does or ``stop`` is set.

    Run again after every reconnect: a restarted server may have lost its store.
    """
    await recording.keep_streams(
        js, recording_configs(subjects, max_age_s, replicas, max_bytes), stop, retry_s)
