"""The JetStream stream recording every pod's KV block-set changes (``LIG_KVBLOCKS``).

Like the snapshots' stream (:mod:`shared.recording` keeps both), with a size limit as well:
block changes of a busy fleet are far bigger than its snapshots. It is also where a starting
bridge (or a replica taking a pod over) learns where each pod's stream stood: the last message
recorded on the pod's subject.
"""

from __future__ import annotations

import logging

import msgspec
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import StreamConfig
from nats.js.errors import NotFoundError

from shared.kv_blocks import KVBlockChanges, decode
from shared.recording import recording_config
from shared.subjects import Subjects

log = logging.getLogger("lig.kv_events.recording")


def stream_config(subjects: Subjects, max_age_s: float, max_bytes: int,
                  replicas: int = 1) -> StreamConfig:
    """File-backed, ``replicas`` copies, oldest first out past ``max_age_s`` or ``max_bytes``."""
    return recording_config(subjects.kv_blocks_stream, subjects.all_kv_blocks(),
                            "KV block-set changes of every pod, recorded for replay",
                            max_age_s, max_bytes, replicas)


async def last_recorded(js: JetStreamContext, stream: str, subject: str
                        ) -> KVBlockChanges | None:
    """The last block changes recorded on ``subject`` (one pod's), None when there are none or
    the recording cannot be read (logged: the pod's stream then starts as without a
    recording)."""
    try:
        message = await js.get_last_msg(stream, subject)
    except NotFoundError:
        return None  # no such stream, or nothing recorded on the subject
    except (NatsError, TimeoutError) as exc:
        log.warning("cannot read the last block changes recorded on %s (%s: %s): starting "
                    "its stream from 0", subject, type(exc).__name__, exc)
        return None
    try:
        return decode(message.data or b"")
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("the last block changes recorded on %s do not decode (%s): starting its "
                    "stream from 0", subject, exc)
        return None
