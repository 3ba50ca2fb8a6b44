"""The JetStream stream recording every pod's KV block-set changes (``LIG_KVBLOCKS``).

Like the snapshots' stream (:mod:`shared.recording` keeps both), with a size limit as well:
block changes of a busy fleet are far bigger than its snapshots.
"""

from __future__ import annotations

from nats.js.api import StreamConfig

from shared.recording import recording_config
from shared.subjects import Subjects


def stream_config(subjects: Subjects, max_age_s: float, max_bytes: int,
                  replicas: int = 1) -> StreamConfig:
    """File-backed, ``replicas`` copies, oldest first out past ``max_age_s`` or ``max_bytes``."""
    return recording_config(subjects.kv_blocks_stream, subjects.all_kv_blocks(),
                            "KV block-set changes of every pod, recorded for replay",
                            max_age_s, max_bytes, replicas)
