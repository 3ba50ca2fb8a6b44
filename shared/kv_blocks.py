"""The compact per-pod KV block-set changes ``lig kv-events`` publishes on NATS.

One message per vLLM event batch applied, on ``<prefix>.kvblocks.<pool>.<pod>``: the batch's
events in order, with every hash a uint64 (see :mod:`shared.kv_events`), encoded as tagged
positional arrays. A message with ``resync`` set says the consumer lost events it could not
replay: the subscriber must drop what it knows of the pod (``ops`` starts with
``AllBlocksCleared``) and treat the pod's cache as partly unknown until it refills.

``stream_seq`` numbers every message the bridge publishes for one pod's rank, markers included:
0, 1, 2, ... with no hole, continued across bridge restarts and replica handovers from the
bridge's own recording (``<PREFIX>_KVBLOCKS``). A consumer that sees a number skipped lost a
message (a publish NATS never delivered, a subscription that fell behind) and knows its state of
that rank is incomplete (how pickers then score the pod: docs/kv-events.md). 0 after a higher
number means the numbering started over (a bridge without a recording to continue from,
which then republishes the pod's stream from its start or sends a resync marker). -1: a message
of a bridge that did not number them (older versions).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from shared.schemas import SCHEMA_VERSION

Op = BlockStored | BlockRemoved | AllBlocksCleared


class KVBlockChanges(msgspec.Struct, frozen=True):
    """What changed in one pod's (one data-parallel rank's) prefix cache."""

    pool: str
    pod: str
    address: str
    """The pod's ``ip:port`` (what pickers route to)."""
    source_seq: int
    """vLLM's sequence number of the batch; -1 for a marker the consumer made itself."""
    ts: float
    ops: list[Op]
    dp_rank: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)] = 0
    """The data-parallel rank (0..65,535, as ``lig kv-events`` accepts them from vLLM)."""
    resync: bool = False
    schema: int = SCHEMA_VERSION
    stream_seq: int = -1
    """The bridge's own contiguous number of this message for its pod and rank (see the
    module's docstring); -1 when not numbered. Last, with a default: older messages decode."""


def marker(pool: str, pod: str, address: str, dp_rank: int, ts: float, *,
           resync: bool) -> KVBlockChanges:
    """A rank's cache is empty (``AllBlocksCleared``, ``source_seq`` -1); with ``resync``,
    changes were lost too, so it is partly unknown until it refills."""
    return KVBlockChanges(pool, pod, address, -1, ts, [AllBlocksCleared()], dp_rank,
                          resync=resync)


def encode(changes: KVBlockChanges) -> bytes:
    """msgpack bytes of ``changes``."""
    return msgspec.msgpack.encode(changes)


_decoder = msgspec.msgpack.Decoder(KVBlockChanges)


def decode(data: bytes) -> KVBlockChanges:
    """``KVBlockChanges`` from msgpack; msgspec.ValidationError/DecodeError when malformed or of
    another schema version."""
    changes = _decoder.decode(data)
    if changes.schema != SCHEMA_VERSION:
        raise msgspec.ValidationError(f"KVBlockChanges schema {changes.schema}, "
                                      f"expected {SCHEMA_VERSION}")
    return changes
