"""The JetStream streams that record the fleet for replay and export (``lig record``).

Three streams, all file-backed, in ``replicas`` copies on a cluster (:mod:`shared.replication`),
each with an age and a size limit (the oldest messages go first):

- ``LIG_METRICS`` over ``<prefix>.metrics.>``: every snapshot;
- ``LIG_DECISIONS`` over ``<prefix>.decisions.>``: what the pickers publish on the decision
  stream (empty until pickers publish there);
- ``LIG_REGISTRY``: every registry change, *sourced* from the registry bucket's stream
  ``KV_<prefix>-registry``. JetStream forbids two streams with overlapping subjects, so the
  recording cannot listen on ``$KV.<bucket>.>`` itself; a source copies the bucket's messages
  (subject, headers, body) with their origin sequence in the ``Nats-Stream-Source`` header.
  The bucket keeps only the last few revisions per key and no age limit; this stream keeps
  every change for the recording's age.

Snapshots and decisions are published with core NATS; the streams capture them server-side, so
recording adds nothing to the scrape or the request path. The collector creates and maintains
all three: it is the one service that already manages JetStream state for recording, and it
keeps the pickers (many replicas, on the request path) free of stream administration.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig, StreamSource
from nats.js.errors import APIError, NotFoundError

from shared.logs import RateLimitedLog
from shared.replication import align_replicas
from shared.subjects import Subjects

log = logging.getLogger("lig.collector.recording")

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


def _limited(name: str, description: str, max_age_s: float, max_bytes: int, replicas: int,
             **where: object) -> StreamConfig:
    return StreamConfig(
        name=name, description=description, retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE, discard=DiscardPolicy.OLD, max_age=max_age_s,
        max_bytes=max_bytes, num_replicas=replicas, **where,  # type: ignore[arg-type]
    )


def stream_config(subjects: Subjects, max_age_s: float, replicas: int = 1,
                  max_bytes: int = METRICS_MAX_BYTES) -> StreamConfig:
    """The snapshot recording: oldest messages expire after ``max_age_s`` or ``max_bytes``."""
    return _limited(subjects.metrics_stream, "metric snapshots of every pod, recorded for replay",
                    max_age_s, max_bytes, replicas, subjects=[subjects.all_metrics()])


def recording_configs(subjects: Subjects, max_age_s: float, replicas: int = 1,
                      max_bytes: StreamBytes = DEFAULT_BYTES) -> list[StreamConfig]:
    """The three recording streams (metrics, decisions, registry)."""
    return [
        stream_config(subjects, max_age_s, replicas, max_bytes.metrics),
        _limited(subjects.decisions_stream, "the pickers' decisions, recorded for replay",
                 max_age_s, max_bytes.decisions, replicas,
                 subjects=[subjects.recorded_decisions()]),
        _limited(subjects.registry_stream, "every registry change, recorded for replay",
                 max_age_s, max_bytes.registry, replicas,
                 sources=[StreamSource(name=registry_source(subjects))]),
    ]


def _sources(config: StreamConfig) -> set[str]:
    return {source.name for source in config.sources or ()}


def _differs(current: StreamConfig, wanted: StreamConfig) -> bool:
    return (set(current.subjects or ()) != set(wanted.subjects or ())
            or _sources(current) != _sources(wanted)
            or current.max_age != wanted.max_age
            or (current.max_bytes or -1) != (wanted.max_bytes or -1))


async def ensure_config(js: JetStreamContext, wanted: StreamConfig) -> str:
    """Create the stream ``wanted`` describes, or align an existing one's subjects, sources,
    limits and replicas; returns what it did.

    A replica count the cluster cannot place is logged and the stream keeps recording with its
    old count: recording matters more than the setting.
    """
    assert wanted.name is not None
    replicas = wanted.num_replicas or 1
    try:
        info = await js.stream_info(wanted.name)
    except NotFoundError:
        await js.add_stream(wanted)
        return "created"
    current = info.config
    action = "unchanged"
    if _differs(current, wanted):
        current.subjects = wanted.subjects
        current.sources = wanted.sources
        current.max_age = wanted.max_age
        current.max_bytes = wanted.max_bytes
        await js.update_stream(current)
        action = "updated"
    try:
        if await align_replicas(js, wanted.name, replicas):
            action = f"updated to {replicas} replicas"
    except APIError as exc:
        log.error("stream %s: cannot change to %d replicas, keeping %d: %s",
                  wanted.name, replicas, current.num_replicas or 1, exc)
    return action


async def ensure_stream(js: JetStreamContext, subjects: Subjects, max_age_s: float,
                        replicas: int = 1, max_bytes: int = METRICS_MAX_BYTES) -> str:
    """Create or align the snapshot recording stream alone; returns what it did."""
    return await ensure_config(js, stream_config(subjects, max_age_s, replicas, max_bytes))


async def ensure_recording(js: JetStreamContext, subjects: Subjects, max_age_s: float,
                           replicas: int = 1, max_bytes: StreamBytes = DEFAULT_BYTES
                           ) -> dict[str, str]:
    """Create or align every recording stream; what was done, by stream name."""
    done = {}
    for config in recording_configs(subjects, max_age_s, replicas, max_bytes):
        assert config.name is not None
        done[config.name] = await ensure_config(js, config)
    return done


async def keep_stream(
    js: JetStreamContext,
    subjects: Subjects,
    max_age_s: float,
    stop: asyncio.Event,
    retry_s: float = 1.0,
    replicas: int = 1,
    max_bytes: StreamBytes = DEFAULT_BYTES,
) -> None:
    """Ensure the recording streams exist, retrying until they do or ``stop`` is set.

    Run again after every reconnect: a restarted server may have lost its store.
    """
    failures = RateLimitedLog(log)
    while not stop.is_set():
        try:
            done = await ensure_recording(js, subjects, max_age_s, replicas, max_bytes)
        except (NatsError, TimeoutError) as exc:
            failures.warning("cannot ensure the recording streams (%d replicas) yet: %s; "
                             "retrying", replicas, exc)
        else:
            log.info("recording in streams %s (max age %g s, max bytes %d/%d/%d, %d replicas)",
                     ", ".join(f"{name}: {action}" for name, action in done.items()), max_age_s,
                     max_bytes.metrics, max_bytes.decisions, max_bytes.registry, replicas)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), retry_s)
