"""The flight recorder's records in a recording file, in time order, with the registry as it
stood when each was recorded.

Pickers publish :class:`~scheduling.record.RecordBatch` messages on ``<prefix>.records.<pool>``;
``lig record`` stores them as DECISION frames named ``records.<pool>``, beside the decision
stream's ``decisions.<pool>`` frames (not read here). The file is streamed: memory is bounded by
the registry's size and one batch, whatever the file's length. A batch that does not decode (a
newer schema, a foreign message) is counted and logged, not fatal; a truncated or corrupt file
raises :class:`~recording.fileformat.RecordingError` where it is reached.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import BinaryIO

import msgspec

from recording.fileformat import Kind, read_entries
from scheduling.record import DecisionRecord, OutcomeRecord, RecordBatch
from shared.schemas import SCHEMA_VERSION, InferencePool, PolicyConfig
from shared.subjects import pool_key

log = logging.getLogger("lig.records")

RECORDS_NAME = "records."  # frame names of record batches: the subject without the prefix
_batch_decoder = msgspec.msgpack.Decoder(RecordBatch)
_pool_decoder = msgspec.msgpack.Decoder(InferencePool)


class ReadCounts(msgspec.Struct):
    """What a pass over a file read."""

    batches: int = 0
    decisions: int = 0
    outcomes: int = 0
    undecodable: int = 0  # record batches skipped: not a RecordBatch this lig reads
    other_pool: int = 0  # batches of pools the caller did not ask for


class Registry:
    """The registry keys of a recording as of the current point of a pass.

    Values stay encoded; a pool's policy is decoded when asked for and kept until its key
    changes, so a pass decodes each pool revision at most once.
    """

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self._policies: dict[str, tuple[int, PolicyConfig | None]] = {}
        self._revision = 0

    def apply(self, key: str, data: bytes | None) -> None:
        """A key written (``data``) or deleted (None)."""
        if data is None:
            self.values.pop(key, None)
        else:
            self.values[key] = data
        self._policies.pop(key, None)

    def policy(self, pool: str) -> tuple[int, PolicyConfig | None]:
        """The policy the registry names for ``pool`` (None if the pool is absent or its value
        does not decode, logged) and a revision number that changes whenever it may have."""
        key = pool_key(pool)
        cached = self._policies.get(key)
        if cached is not None:
            return cached
        config: PolicyConfig | None = None
        data = self.values.get(key)
        if data is not None:
            try:
                config = _pool_decoder.decode(data).policy
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("registry key %s does not decode as an InferencePool: %s", key, exc)
        self._revision += 1
        cached = self._policies[key] = (self._revision, config)
        return cached


class Recorded(msgspec.Struct, frozen=True):
    """One record with where it came from; ``frame_ns`` is the batch's store time."""

    frame_ns: int
    picker: str
    pool: str
    record: DecisionRecord | OutcomeRecord


def read_records(source: BinaryIO, registry: Registry, counts: ReadCounts,
                 pool: str | None = None) -> Iterator[Recorded]:
    """Every record after the header of ``source``, in file (time) order; ``registry`` is
    brought up to each record's point before it is yielded. ``pool`` keeps one pool's."""
    for kind, entry in read_entries(source):
        if kind == Kind.DECISION:
            if not entry.name.startswith(RECORDS_NAME):
                continue  # the decision stream: what peers share, not the flight records
            batch = _batch(entry.name, entry.data, counts)
            if batch is None:
                continue
            if pool is not None and batch.pool != pool:
                counts.other_pool += 1
                continue
            for record in batch.records:
                if type(record) is DecisionRecord:
                    counts.decisions += 1
                else:
                    counts.outcomes += 1
                yield Recorded(entry.time_ns, batch.picker, batch.pool, record)
        elif kind == Kind.REGISTRY_STATE or kind == Kind.REGISTRY_CHANGE:
            registry.apply(entry.name, entry.data)


def _batch(name: str, data: bytes | None, counts: ReadCounts) -> RecordBatch | None:
    try:
        batch = _batch_decoder.decode(data or b"")
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        _skipped(counts, "skipped an undecodable record batch on %s: %s", name, exc)
        return None
    if batch.schema != SCHEMA_VERSION:
        _skipped(counts, "skipped a record batch on %s with schema %d (this lig reads %d)", name,
                 batch.schema, SCHEMA_VERSION)
        return None
    counts.batches += 1
    return batch


def _skipped(counts: ReadCounts, message: str, *args: object) -> None:
    # The first skip is a warning; the rest only debug lines (the count is in every report), so
    # a file full of a newer schema does not flood the terminal.
    counts.undecodable += 1
    log.log(logging.WARNING if counts.undecodable == 1 else logging.DEBUG, message, *args)
