"""The JetStream stream recording every pod's KV block-set changes (``LIG_KVBLOCKS``).

Like the snapshots' stream: published with core NATS, captured server-side, file storage, the
oldest messages dropped past ``max_age`` seconds or ``max_bytes`` bytes (block changes of a busy
fleet are far bigger than its snapshots, hence the size limit).
"""

from __future__ import annotations

import logging

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from shared.subjects import Subjects

log = logging.getLogger("lig.kv_events.recording")


def stream_config(subjects: Subjects, max_age_s: float, max_bytes: int,
                  replicas: int = 1) -> StreamConfig:
    """File-backed, ``replicas`` copies, oldest first out past ``max_age_s`` or ``max_bytes``."""
    return StreamConfig(
        name=subjects.kv_blocks_stream,
        description="KV block-set changes of every pod, recorded for replay",
        subjects=[subjects.all_kv_blocks()],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=max_age_s,
        max_bytes=max_bytes,
        num_replicas=replicas,
    )


async def ensure_stream(js: JetStreamContext, wanted: StreamConfig) -> str:
    """Create the stream, or align an existing one's subjects and limits; returns what it did."""
    assert wanted.name is not None
    try:
        info = await js.stream_info(wanted.name)
    except NotFoundError:
        await js.add_stream(wanted)
        return "created"
    current = info.config
    if (set(current.subjects or ()) != set(wanted.subjects or ())
            or current.max_age != wanted.max_age or current.max_bytes != wanted.max_bytes):
        current.subjects = wanted.subjects
        current.max_age = wanted.max_age
        current.max_bytes = wanted.max_bytes
        await js.update_stream(current)
        return "updated"
    return "unchanged"


async def try_ensure_stream(js: JetStreamContext, wanted: StreamConfig) -> bool:
    """:func:`ensure_stream`, logging instead of raising; True once the stream is there."""
    try:
        action = await ensure_stream(js, wanted)
    except (NatsError, TimeoutError) as exc:
        log.warning("cannot ensure stream %s yet: %s", wanted.name, exc)
        return False
    log.info("recording KV block changes in stream %s (max age %g s, max %d bytes): %s",
             wanted.name, wanted.max_age or 0, wanted.max_bytes or -1, action)
    return True
