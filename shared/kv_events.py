"""vLLM's KV-cache events on the wire: decode them defensively, and encode them (simulator).

A ZMQ PUB message is ``[topic, seq (8 bytes, big-endian), payload (msgpack)]``; the payload is
``[ts, events]`` or ``[ts, events, data_parallel_rank]`` (a map with those keys is accepted too).
Each event is either a positional array whose first element is its type (vLLM up to 0.23:
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name, extra_keys, group_idx, ...]``) or a map tagged with ``"type"`` (since vLLM PR #42892;
what vLLM 0.33 sends, defaults omitted). Both are accepted in one stream; missing optional fields
get defaults and unknown fields are ignored. See docs/kv-events.md for the sources.

Hybrid models have several KV-cache groups (full attention, sliding window, mamba): each event
names its ``group_idx`` (0 when absent), and a ``BlockStored`` the group's kind. A block stored
with a ``lora_id`` but no ``lora_name`` (vLLM before the name was sent) is filed under the name
the decoder's ``lora_names`` gives that id, else under ``lora-id:<id>``: never as a base-model
block.

Block hashes arrive as uint64, int64 or bytes; :func:`normalise_hash` maps them all to one
uint64 so that a ``BlockRemoved`` finds what its ``BlockStored`` filed, whatever encoding each
used. Malformed input never raises out of :class:`KVEventDecoder`: it is counted by reason,
logged (rate-limited) and skipped, a whole message or a single event at a time.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

import msgspec

from shared.errors import LigError
from shared.logs import RateLimitedLog

log = logging.getLogger("lig.kv_events")

U64 = (1 << 64) - 1
END_SEQ = b"\xff" * 8
"""The replay socket's end marker: sequence -1 as a signed 8-byte big-endian integer."""
MAX_GROUPS = 1024
"""KV-cache groups a pod may have (a hybrid model has a few)."""

Encoding = Literal["array", "map"]
ENCODINGS: tuple[Encoding, ...] = ("array", "map")
HashType = Literal["int", "bytes"]
HASH_TYPES: tuple[HashType, ...] = ("int", "bytes")
"""vLLM sends uint64 block hashes by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), 32-byte
digests otherwise."""


class Limits(msgspec.Struct, frozen=True):
    """Bounds on one message; anything beyond them is skipped, never buffered."""

    max_message_bytes: int = 8 << 20
    max_events: int = 10_000
    """Events in one batch."""
    max_hashes: int = 65_536
    """Block hashes in one event."""
    max_block_size: int = 4_096
    """Token ids per block (a BlockStored carries at most ``len(block_hashes) x block_size``)."""


class BlockStored(msgspec.Struct, array_like=True, tag="s", frozen=True):
    """Blocks entered the prefix cache, in order; ``token_ids`` holds their tokens (may be empty
    when the publisher did not send them)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    group_idx: int = 0
    """The KV-cache group (hybrid models have several; 0 for the rest)."""
    kind: str | None = None
    """The group's kind as vLLM names it (``full_attention``, ``sliding_window``, ``mamba``,
    ...); None when the publisher did not say."""


class BlockRemoved(msgspec.Struct, array_like=True, tag="r", frozen=True):
    """Blocks left the cache (of one KV-cache group)."""

    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int = 0


class AllBlocksCleared(msgspec.Struct, array_like=True, tag="c", frozen=True):
    """The whole cache was emptied (a reset, or a restarted engine)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, frozen=True):
    """One decoded message: its sequence number, time, rank and the events that decoded."""

    seq: int
    ts: float
    events: list[Event]
    dp_rank: int | None = None
    skipped_events: int = 0


def normalise_hash(value: object) -> int | None:
    """One uint64 for a block hash sent as uint64, int64 or bytes; None if it is none of them.

    Bytes of at most 8 are read big-endian (what an int64 would have been); longer ones
    (vLLM's sha256 hashes) are folded to 8 bytes with blake2b."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value & U64 if -(1 << 63) <= value <= U64 else None
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        if not raw:
            return None
        if len(raw) > 8:
            raw = hashlib.blake2b(raw, digest_size=8).digest()
        return int.from_bytes(raw, "big")
    return None


# Typed shapes of well-formed batches: msgspec checks them in C, which is most of the decoding
# cost saved. Anything they reject goes through the tolerant path below, which decides.
_Token = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints stop at 2**64 - 1
_Rank = Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
_Group = Annotated[int, msgspec.Meta(ge=0, lt=MAX_GROUPS)]
_LoraId = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints stop at 2**64 - 1


class _MapStored(msgspec.Struct, tag_field="type", tag="BlockStored"):
    block_hashes: list[int | bytes]
    block_size: int
    parent_block_hash: int | bytes | None = None
    token_ids: list[_Token] = []
    lora_id: _LoraId | None = None
    medium: str | None = None
    lora_name: str | None = None
    group_idx: _Group | None = None
    kv_cache_spec_kind: str | None = None


class _MapRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: _Group | None = None


class _MapCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class _ArrayStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[_Token]
    block_size: int
    lora_id: _LoraId | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Any = None
    group_idx: _Group | None = None
    kv_cache_spec_kind: str | None = None


class _ArrayRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: _Group | None = None


class _ArrayCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class _MapBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    ts: float
    events: list[_MapStored | _MapRemoved | _MapCleared]
    data_parallel_rank: _Rank | None = None


class _ArrayBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    ts: float
    events: list[_ArrayStored | _ArrayRemoved | _ArrayCleared]
    data_parallel_rank: _Rank | None = None


class _KeyedBatch(msgspec.Struct):
    """An ``EventBatch`` encoded as a map (a publisher without ``array_like``)."""

    ts: float
    events: list[_MapStored | _MapRemoved | _MapCleared]
    data_parallel_rank: _Rank | None = None


class _Malformed(LigError, ValueError):
    """Why one event or message was skipped (the reason is the counter's label)."""


# Positional field order of vLLM's array-encoded events (after the type tag).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class KVEventDecoder:
    """Decodes messages from one or more pods; ``skipped`` counts what was dropped, by reason."""

    def __init__(self, limits: Limits | None = None,
                 on_skip: Callable[[str], None] = lambda reason: None,
                 lora_names: Mapping[int, str] | None = None) -> None:
        self.limits = limits or Limits()
        self._on_skip = on_skip
        self._lora_names = dict(lora_names or {})
        self.skipped: Counter[str] = Counter()
        self._payload = msgspec.msgpack.Decoder()
        self._typed = (msgspec.msgpack.Decoder(_MapBatch), msgspec.msgpack.Decoder(_ArrayBatch),
                       msgspec.msgpack.Decoder(_KeyedBatch))
        self._log = RateLimitedLog(log)

    def adapter(self, lora_name: object, lora_id: object) -> str | None:
        """The adapter a block is filed under: its name, else the name ``lora_names`` gives
        its id, else ``lora-id:<id>``; None for the base model."""
        if isinstance(lora_name, str):
            return lora_name[:256]
        if type(lora_id) is not int:
            return None
        return self._lora_names.get(lora_id) or f"lora-id:{lora_id}"

    def decode_message(self, frames: list[bytes]) -> EventBatch | None:
        """A PUB message ``[topic, seq, payload]``; None (counted, logged) if it is malformed."""
        if len(frames) != 3:
            self._skip("frames", f"{len(frames)} frames, expected 3")
            return None
        seq = frames[1]
        if len(seq) != 8:
            self._skip("seq", f"sequence of {len(seq)} bytes, expected 8")
            return None
        return self.decode_payload(int.from_bytes(seq, "big"), frames[2])

    def decode_payload(self, seq: int, payload: bytes) -> EventBatch | None:
        """The msgpack payload of message ``seq``; None (counted, logged) if it is malformed."""
        if len(payload) > self.limits.max_message_bytes:
            self._skip("size", f"seq {seq}: {len(payload)} bytes")
            return None
        fast = self._decode_typed(seq, payload)
        return fast if fast is not None else self._decode_tolerant(seq, payload)

    def _decode_tolerant(self, seq: int, payload: bytes) -> EventBatch | None:
        """Field by field: keeps the events that decode, counts the others."""
        try:
            raw = self._payload.decode(payload)
        except (msgspec.DecodeError, ValueError, RecursionError) as exc:
            self._skip("msgpack", f"seq {seq}: {exc}")
            return None
        try:
            return self._batch(seq, raw)
        except _Malformed as exc:
            self._skip(exc.args[0], f"seq {seq}: {exc.args[1]}")
            return None

    def _decode_typed(self, seq: int, payload: bytes) -> EventBatch | None:
        """The batch if it is well-formed in one encoding, within the limits; else None (the
        tolerant path then decides what to keep and what to count)."""
        for decoder in self._typed:
            try:
                raw = decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError, RecursionError):
                continue
            limits = self.limits
            if len(raw.events) > limits.max_events:
                return None
            events: list[Event] = []
            for event in raw.events:
                if isinstance(event, _MapRemoved | _ArrayRemoved):
                    hashes = _typed_hashes(event.block_hashes, limits)
                    if hashes is None:
                        return None
                    events.append(BlockRemoved(hashes, _optional_str(event.medium),
                                               event.group_idx or 0))
                elif isinstance(event, _MapCleared | _ArrayCleared):
                    events.append(AllBlocksCleared())
                else:
                    hashes = _typed_hashes(event.block_hashes, limits)
                    parent = event.parent_block_hash
                    block_size = event.block_size
                    if hashes is None or not 0 < block_size <= limits.max_block_size \
                            or len(event.token_ids) > len(hashes) * block_size:
                        return None
                    if parent is not None:
                        parent = normalise_hash(parent)
                        if parent is None:
                            return None
                    events.append(BlockStored(hashes, parent, tuple(event.token_ids), block_size,
                                              self.adapter(event.lora_name, event.lora_id),
                                              _optional_str(event.medium),
                                              event.group_idx or 0,
                                              _optional_str(event.kv_cache_spec_kind)))
            return EventBatch(seq, raw.ts, events, raw.data_parallel_rank, 0)
        return None

    def _skip(self, reason: str, detail: str) -> None:
        self.skipped[reason] += 1
        self._on_skip(reason)
        self._log.warning("skipping a malformed KV-event message (%s): %s", reason, detail)

    def _batch(self, seq: int, raw: Any) -> EventBatch:
        if isinstance(raw, dict) and "ts" in raw and "events" in raw:
            raw = [raw["ts"], raw["events"], raw.get("data_parallel_rank")]
        if not isinstance(raw, list) or not 2 <= len(raw) <= 3:
            raise _Malformed("batch", "payload is not [ts, events(, dp_rank)]")
        ts, events = raw[0], raw[1]
        if isinstance(ts, bool) or not isinstance(ts, int | float):
            raise _Malformed("batch", "ts is not a number")
        if not isinstance(events, list):
            raise _Malformed("batch", "events is not an array")
        if len(events) > self.limits.max_events:
            raise _Malformed("events", f"{len(events)} events in one batch")
        rank = raw[2] if len(raw) == 3 else None
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)
                                 or not 0 <= rank < 1 << 16):
            raise _Malformed("batch", "data_parallel_rank is not a small integer")
        decoded: list[Event] = []
        skipped = 0
        for raw_event in events:
            try:
                decoded.append(self._event(raw_event))
            except _Malformed as exc:
                skipped += 1
                self._skip(exc.args[0], f"seq {seq}: {exc.args[1]}")
        return EventBatch(seq, float(ts), decoded, rank, skipped)

    def _event(self, raw: Any) -> Event:
        if isinstance(raw, list) and raw and isinstance(raw[0], str):
            kind = raw[0]
            names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS
            fields = dict(zip(names, raw[1:], strict=False))
        elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
            kind, fields = raw["type"], raw
        else:
            raise _Malformed("event", "neither a tagged array nor a map with a 'type'")
        if kind == "BlockStored":
            return self._stored(fields)
        if kind == "BlockRemoved":
            return BlockRemoved(self._hashes(fields), _optional_str(fields.get("medium")),
                                _group(fields))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        raise _Malformed("type", f"unknown event type {kind[:40]!r}")

    def _stored(self, fields: dict[Any, Any]) -> BlockStored:
        limits = self.limits
        hashes = self._hashes(fields)
        parent_raw = fields.get("parent_block_hash")
        parent = None if parent_raw is None else normalise_hash(parent_raw)
        if parent_raw is not None and parent is None:
            raise _Malformed("hash", "parent_block_hash is not a hash")
        block_size = fields.get("block_size")
        if isinstance(block_size, bool) or not isinstance(block_size, int) \
                or not 0 < block_size <= limits.max_block_size:
            raise _Malformed("block_size", f"block_size {str(block_size)[:20]}")
        token_ids = fields.get("token_ids") or []
        if not isinstance(token_ids, list) or len(token_ids) > len(hashes) * block_size:
            raise _Malformed("token_ids", "token_ids is not an array of at most "
                                          "len(block_hashes) x block_size")
        if not all(type(token) is int and 0 <= token <= U64 for token in token_ids):
            raise _Malformed("token_ids", "a token id is not an unsigned integer")
        lora_id = fields.get("lora_id")
        if lora_id is not None and (type(lora_id) is not int or not 0 <= lora_id <= U64):
            raise _Malformed("lora_id", "lora_id is not an unsigned integer")
        return BlockStored(hashes, parent, tuple(token_ids), block_size,
                           self.adapter(fields.get("lora_name"), lora_id),
                           _optional_str(fields.get("medium")), _group(fields),
                           _optional_str(fields.get("kv_cache_spec_kind")))

    def _hashes(self, fields: dict[Any, Any]) -> tuple[int, ...]:
        raw = fields.get("block_hashes")
        if not isinstance(raw, list) or not raw:
            raise _Malformed("hash", "block_hashes is not a non-empty array")
        if len(raw) > self.limits.max_hashes:
            raise _Malformed("hash", f"{len(raw)} block hashes in one event")
        hashes = []
        for value in raw:
            normalised = normalise_hash(value)
            if normalised is None:
                raise _Malformed("hash", "a block hash is not an integer or bytes")
            hashes.append(normalised)
        return tuple(hashes)


def _typed_hashes(raw: list[int | bytes], limits: Limits) -> tuple[int, ...] | None:
    """Normalised hashes of a typed event, or None if they break a rule."""
    if not raw or len(raw) > limits.max_hashes:
        return None
    hashes = []
    for value in raw:
        normalised = value & U64 if type(value) is int else normalise_hash(value)
        if normalised is None:
            return None
        hashes.append(normalised)
    return tuple(hashes)


def _group(fields: dict[Any, Any]) -> int:
    """The event's KV-cache group (0 when absent); _Malformed if it is no group number."""
    group = fields.get("group_idx")
    if group is None:
        return 0
    if type(group) is not int or not 0 <= group < MAX_GROUPS:
        raise _Malformed("group_idx", f"group_idx {str(group)[:20]}")
    return group


def _optional_str(value: object) -> str | None:
    return value[:256] if isinstance(value, str) else None


def _encode_hash(value: int, hashes: HashType) -> int | bytes:
    """A block hash as vLLM sends it: uint64 (``value`` may be signed), or (``bytes``) 32
    bytes."""
    value &= U64
    return value if hashes == "int" else value.to_bytes(32, "big")


def encode_event(event: Event, encoding: Encoding,
                 hashes: HashType = "int") -> list[Any] | dict[str, Any]:
    """``event`` as vLLM encodes it: a positional array of the fields vLLM 0.23 had
    (``array``), or a map tagged with ``"type"`` whose fields with defaults are left out when
    they hold them, as vLLM 0.33 sends it (``map``)."""
    kind = type(event).__name__
    fields: dict[str, Any] = {}
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        fields = {
            "block_hashes": [_encode_hash(value, hashes) for value in event.block_hashes],
            "parent_block_hash": None if parent is None else _encode_hash(parent, hashes),
            "token_ids": list(event.token_ids), "block_size": event.block_size, "lora_id": None,
            "medium": event.medium, "lora_name": event.lora_name}
        if encoding == "map":
            fields["group_idx"] = event.group_idx
            if event.kind is not None:
                fields["kv_cache_spec_kind"] = event.kind
    elif isinstance(event, BlockRemoved):
        fields = {"block_hashes": [_encode_hash(value, hashes) for value in event.block_hashes],
                  "medium": event.medium}
        if encoding == "map":
            fields["group_idx"] = event.group_idx
    if encoding == "array":
        return [kind, *fields.values()]
    return {"type": kind, **fields}


def encode_payload(ts: float, events: list[Event], encoding: Encoding,
                   dp_rank: int | None = 0, hashes: HashType = "int") -> bytes:
    """The msgpack payload of one batch; ``dp_rank`` None leaves the rank out (older vLLM)."""
    body: list[Any] = [ts, [encode_event(event, encoding, hashes) for event in events]]
    if dp_rank is not None:
        body.append(dp_rank)
    return msgspec.msgpack.encode(body)
