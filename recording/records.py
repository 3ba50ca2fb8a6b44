"""The flight recorder's records in a recording file, in time order, with the registry as it
stood when each was recorded.

Pickers publish :class:`~scheduling.record.RecordBatch` messages on ``<prefix>.records.<pool>``;
``lig record`` stores them as DECISION frames named ``records.<pool>``, beside the decision
stream's ``decisions.<pool>`` frames (not read here). The file is streamed: memory is bounded by
the registry's size (with a few revisions per pool key) and one batch, whatever the file's
length. :func:`read_records` decodes every record; :func:`find_records` only those of one
request id. A batch or record that does not decode (a newer schema, a foreign message) is
counted and logged, not fatal; a truncated or corrupt file raises
:class:`~recording.fileformat.RecordingError` where it is reached.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from typing import BinaryIO, TypeVar

import msgspec

from recording.fileformat import Kind, read_entries
from scheduling.record import DecisionRecord, OutcomeRecord, RecordBatch
from shared.schemas import SCHEMA_VERSION, InferencePool, PolicyConfig
from shared.subjects import pool_key

log = logging.getLogger("lig.records")

POOL_PREFIX = "pool."  # registry keys of InferencePools (shared.subjects.pool_key)
RECORDS_NAME = "records."  # frame names of record batches: the subject without the prefix
MAX_PREFIX_BLOCKS = 1 << 16  # far above any picker's hashed blocks: a larger count is garbage
POOL_HISTORY = 16  # revisions kept per pool key: records trail a registry change by milliseconds
_batch_decoder = msgspec.msgpack.Decoder(RecordBatch)
_pool_decoder = msgspec.msgpack.Decoder(InferencePool)


class ReadCounts(msgspec.Struct):
    """What a pass over a file read."""

    batches: int = 0
    decisions: int = 0
    outcomes: int = 0
    # Record batches skipped (not a RecordBatch this lig reads) and decision records skipped
    # (values no picker records).
    undecodable: int = 0
    other_pool: int = 0  # batches of pools the caller did not ask for
    first_skip: str = ""  # why the first skip happened: a report shows one line, not one each

    def skip(self, message: str, *args: object) -> None:
        """Count one message skipped as undecodable; ``message % args`` says why.

        A debug line only: the count is in every report, a file full of a newer schema does
        not flood the terminal, and a corrupt file's garbage before the error stays quiet.
        The reason is formatted for the first skip alone (the rest cost a counter)."""
        self.undecodable += 1
        if not self.first_skip:
            self.first_skip = message % args
        log.debug(message, *args)


PolicyTag = tuple[str, bytes]


def config_tag(config: PolicyConfig) -> PolicyTag:
    """A hashable stand-in for ``config``: equal for equal configs (a picker rebuilds its
    policy only when the config changes, not on every write of the pool's key)."""
    return config.name, msgspec.json.encode(config.params)


class _PoolRevision:
    """One write of a pool key; its policy decoded when first asked for."""

    __slots__ = ("data", "decoded", "policy", "time_ns")

    def __init__(self, time_ns: int, data: bytes | None) -> None:
        self.time_ns = time_ns
        self.data = data
        self.decoded = False
        self.policy: tuple[PolicyConfig, PolicyTag] | None = None


class Registry:
    """The registry keys of a recording as of the current point of a pass, and the last few
    revisions of each pool key.

    A picker publishes its records in batches, so a record decided just before a registry
    change can come after the change in the file: a record's policy is looked up by the
    record's time among the pool's recent revisions, not by file order. Values stay encoded;
    a revision's policy is decoded once, when first asked for.
    """

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self._pools: dict[str, deque[_PoolRevision]] = {}
        self._keys: dict[str, str] = {}  # pool name -> its key (escaping is not free)

    def apply(self, key: str, data: bytes | None, time_ns: int = 0) -> None:
        """A key written (``data``) or deleted (None) at ``time_ns``."""
        if data is None:
            self.values.pop(key, None)
        else:
            self.values[key] = data
        if key.startswith(POOL_PREFIX):
            history = self._pools.get(key)
            if history is None:
                history = self._pools[key] = deque(maxlen=POOL_HISTORY)
            history.append(_PoolRevision(time_ns, data))

    def policy(self, pool: str, at_ns: int | None = None) -> PolicyConfig | None:
        """The policy the registry named for ``pool`` at ``at_ns`` (default: now); None if the
        pool was absent or its value does not decode (logged)."""
        tagged = self.tagged_policy(pool, at_ns)
        return tagged[0] if tagged is not None else None

    def tagged_policy(self, pool: str, at_ns: int | None = None
                      ) -> tuple[PolicyConfig, PolicyTag] | None:
        """:meth:`policy` with its :func:`config_tag`, both made once per revision."""
        key = self._keys.get(pool)
        if key is None:
            key = self._keys[pool] = pool_key(pool)
        history = self._pools.get(key)
        if not history:
            return None
        chosen = history[0]  # older than every kept revision: the oldest is the best guess
        for entry in reversed(history):
            if at_ns is None or entry.time_ns <= at_ns:
                chosen = entry
                break
        if not chosen.decoded:
            chosen.decoded = True
            if chosen.data is not None:
                try:
                    config = _pool_decoder.decode(chosen.data).policy
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    log.warning("registry key %s does not decode as an InferencePool: %s",
                                key, exc)
                else:
                    chosen.policy = (config, config_tag(config))
        return chosen.policy


class Recorded(msgspec.Struct, frozen=True):
    """One record with where it came from; ``frame_ns`` is the batch's store time."""

    frame_ns: int
    picker: str
    pool: str
    record: DecisionRecord | OutcomeRecord


class _LazyBatch(msgspec.Struct, frozen=True):
    """A RecordBatch with its records left encoded (decoded one by one when wanted)."""

    picker: str
    pool: str
    sent_at_ns: int
    records: list[msgspec.Raw]
    schema: int = SCHEMA_VERSION


class _DecisionId(msgspec.Struct, frozen=True, array_like=True, tag="d"):
    """A DecisionRecord's first field only (array-like structs ignore trailing fields)."""

    request_id: str


class _OutcomeId(msgspec.Struct, frozen=True, array_like=True, tag="o"):
    """An OutcomeRecord's first field only."""

    request_id: str


_lazy_decoder = msgspec.msgpack.Decoder(_LazyBatch)
_id_decoder = msgspec.msgpack.Decoder(_DecisionId | _OutcomeId)
_record_decoder = msgspec.msgpack.Decoder(DecisionRecord | OutcomeRecord)
_Batch = TypeVar("_Batch", RecordBatch, _LazyBatch)


def read_records(source: BinaryIO, registry: Registry, counts: ReadCounts,
                 pool: str | None = None, outcomes: bool = True) -> Iterator[Recorded]:
    """Every record after the header of ``source``, in file (time) order; ``registry`` is
    brought up to each record's point before it is yielded. ``pool`` keeps one pool's;
    ``outcomes`` False yields only decisions (outcomes are still counted)."""
    for time_ns, name, batch in _batches(source, registry, counts, _batch_decoder, pool):
        for record in batch.records:
            if type(record) is DecisionRecord:
                if not _usable(record, name, counts):
                    continue
                counts.decisions += 1
            else:
                counts.outcomes += 1
                if not outcomes:
                    continue
            yield Recorded(time_ns, batch.picker, batch.pool, record)


def find_records(source: BinaryIO, registry: Registry, counts: ReadCounts,
                 request_id: str) -> Iterator[Recorded]:
    """The records of ``request_id`` in ``source``, as :func:`read_records` gives them; every
    other record is only decoded as far as its request id (a fraction of a record's cost)."""
    for time_ns, name, batch in _batches(source, registry, counts, _lazy_decoder, None):
        for raw in batch.records:
            try:
                head = _id_decoder.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                counts.skip("a record on %s does not decode: %s", name, exc)
                continue
            if type(head) is _DecisionId:
                counts.decisions += 1
            else:
                counts.outcomes += 1
            if head.request_id != request_id:
                continue
            try:
                record = _record_decoder.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                counts.skip("a record on %s does not decode: %s", name, exc)
                continue
            if type(record) is DecisionRecord and not _usable(record, name, counts):
                continue
            yield Recorded(time_ns, batch.picker, batch.pool, record)


def _usable(record: DecisionRecord, name: str, counts: ReadCounts) -> bool:
    if 0 <= record.prefix_blocks <= MAX_PREFIX_BLOCKS:
        return True
    counts.skip("a decision record on %s has %d prefix blocks", name, record.prefix_blocks)
    return False


def _batches(source: BinaryIO, registry: Registry, counts: ReadCounts,
             decoder: msgspec.msgpack.Decoder[_Batch], pool: str | None
             ) -> Iterator[tuple[int, str, _Batch]]:
    """The record batches of ``source`` (of ``pool``, if given) with their frame time and
    name; registry frames applied to ``registry`` on the way."""
    for kind, entry in read_entries(source):
        if kind == Kind.DECISION:
            if not entry.name.startswith(RECORDS_NAME):
                continue  # the decision stream: what peers share, not the flight records
            try:
                batch = decoder.decode(entry.data or b"")
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                counts.skip("a record batch on %s does not decode: %s", entry.name, exc)
                continue
            if batch.schema != SCHEMA_VERSION:
                counts.skip("a record batch on %s has schema %d (this lig reads %d)", entry.name,
                            batch.schema, SCHEMA_VERSION)
                continue
            counts.batches += 1
            if pool is not None and batch.pool != pool:
                counts.other_pool += 1
                continue
            yield entry.time_ns, entry.name, batch
        elif kind == Kind.REGISTRY_STATE or kind == Kind.REGISTRY_CHANGE:
            registry.apply(entry.name, entry.data, entry.time_ns)
