"""The recording file: versioned, compressed, streamed in and out (see docs/recording.md).

Layout::

    magic      8 bytes  b"\\x89LIGREC\\n"
    version    u16 big-endian (FORMAT_VERSION)
    length     u32 big-endian, then that many bytes of msgpack FileHeader (uncompressed)
    body       one zlib stream (deflate + Adler-32) of frames:
                 kind u8, length u32 big-endian, msgpack payload
               the last frame is END (payload: Trailer); nothing follows the zlib stream

Every frame but END carries an :class:`Entry`. Readers skip frame kinds they do not know, so
new kinds (the full decision records) can be added without a version bump; the version changes
only when an existing reader would misread the file.
"""

from __future__ import annotations

import enum
import struct
import zlib
from collections.abc import Iterator
from typing import BinaryIO

import msgspec

from shared.errors import InputError

MAGIC = b"\x89LIGREC\n"
FORMAT_VERSION = 1
_PREAMBLE = struct.Struct(">HI")  # version, header length
_FRAME = struct.Struct(">BI")  # kind, payload length
MAX_HEADER_BYTES = 1 << 20
MAX_FRAME_BYTES = 64 << 20  # far above any NATS message (1 MB by default, 64 MB at most)
READ_CHUNK = 1 << 16
COMPRESSION_LEVEL = 6


class RecordingError(InputError, ValueError):
    """A file that is not a recording, is from a newer format, truncated or corrupt; the
    message is one line for the user."""


class Kind(enum.IntEnum):
    """What a frame holds."""

    REGISTRY_STATE = 1  # a registry key's value as of the window start
    REGISTRY_CHANGE = 2  # a registry key written or deleted inside the window
    SNAPSHOT = 3  # a PodMetrics message as published
    DECISION = 4  # a message of the decision stream, opaque
    END = 255  # the trailer; the last frame


class FileHeader(msgspec.Struct, frozen=True):
    """What the file covers; written before the compressed body."""

    created_ns: int
    from_ns: int
    to_ns: int
    prefix: str  # the prefix the records were published under
    pool: str | None = None  # only this pool was exported, else every pool
    source: str = ""  # where it was recorded (a host name, never credentials)


class Entry(msgspec.Struct, array_like=True, frozen=True):
    """One recorded message. ``name`` is the subject without ``<prefix>.`` for snapshots and
    decisions, the KV key for registry frames; ``data`` None is a registry delete."""

    time_ns: int
    name: str
    data: bytes | None


class Trailer(msgspec.Struct, frozen=True):
    """The END frame: how many frames of each kind came before it."""

    counts: dict[str, int]


_COUNT_NAMES = {kind: kind.name.lower() for kind in Kind}
_entry_decoder = msgspec.msgpack.Decoder(Entry)
_encoder = msgspec.msgpack.Encoder()


class Writer:
    """Writes a recording to an open binary file, frame by frame (compressed in chunks)."""

    def __init__(self, out: BinaryIO, header: FileHeader) -> None:
        self._out = out
        self._compressor = zlib.compressobj(COMPRESSION_LEVEL)
        self._pending = bytearray()  # frames not compressed yet: one zlib call per chunk
        self.counts: dict[str, int] = {}
        raw = _encoder.encode(header)
        out.write(MAGIC + _PREAMBLE.pack(FORMAT_VERSION, len(raw)) + raw)

    def _frame(self, kind: int, payload: bytes) -> None:
        self._pending += _FRAME.pack(kind, len(payload))
        self._pending += payload
        if len(self._pending) >= READ_CHUNK:
            self._out.write(self._compressor.compress(self._pending))
            self._pending.clear()

    def add(self, kind: Kind, entry: Entry) -> None:
        """Append one entry of ``kind``."""
        self._frame(kind, _encoder.encode(entry))
        name = _COUNT_NAMES[kind]
        self.counts[name] = self.counts.get(name, 0) + 1

    def close(self) -> None:
        """Write the END frame and finish the compressed stream (the file stays open)."""
        self._frame(Kind.END, _encoder.encode(Trailer(dict(self.counts))))
        self._out.write(self._compressor.compress(self._pending) + self._compressor.flush())
        self._pending.clear()


def read_header(source: BinaryIO) -> FileHeader:
    """The header of a recording; RecordingError if it is not one this reader can read."""
    magic = source.read(len(MAGIC))
    if magic != MAGIC:
        raise RecordingError("not a lig recording (bad magic bytes)")
    preamble = source.read(_PREAMBLE.size)
    if len(preamble) < _PREAMBLE.size:
        raise RecordingError("truncated recording: the header is incomplete")
    version, length = _PREAMBLE.unpack(preamble)
    if version > FORMAT_VERSION:
        raise RecordingError(f"recording format version {version} is newer than this lig reads "
                             f"(up to {FORMAT_VERSION}): upgrade lig to read it")
    if version < 1 or length > MAX_HEADER_BYTES:
        raise RecordingError(f"corrupt recording: header says version {version}, "
                             f"{length} header bytes")
    raw = source.read(length)
    if len(raw) < length:
        raise RecordingError("truncated recording: the header is incomplete")
    try:
        return msgspec.msgpack.decode(raw, type=FileHeader)
    except msgspec.DecodeError as exc:
        raise RecordingError(f"corrupt recording header: {exc}") from None


class _Inflater:
    """The decompressed body as a byte stream read in bounded chunks."""

    def __init__(self, source: BinaryIO) -> None:
        self._source = source
        self._inflater = zlib.decompressobj()
        self._buffer = bytearray()

    def _fill(self) -> bool:
        """Decompress more input; False once the compressed stream is exhausted."""
        while True:
            if self._inflater.eof:
                return False
            chunk = self._inflater.unconsumed_tail or self._source.read(READ_CHUNK)
            if not chunk:
                raise RecordingError("truncated recording: the compressed body ends early")
            try:
                out = self._inflater.decompress(chunk, READ_CHUNK)
            except zlib.error as exc:
                raise RecordingError(f"corrupt recording: {exc}") from None
            if out:
                self._buffer += out
                return True

    def read(self, size: int) -> bytes:
        """Exactly ``size`` bytes; RecordingError if the body ends first."""
        while len(self._buffer) < size:
            if not self._fill():
                raise RecordingError("truncated recording: a frame is cut short")
        out = bytes(self._buffer[:size])
        del self._buffer[:size]
        return out

    def finished(self) -> bool:
        """True when nothing but the end of the compressed stream remains."""
        if self._buffer:
            return False
        while self._fill():
            if self._buffer:
                return False
        return not self._inflater.unused_data and not self._source.read(1)


def read_entries(source: BinaryIO) -> Iterator[tuple[Kind, Entry]]:
    """Every entry after the header, in file order; RecordingError on a truncated or corrupt
    body (raised when reached: what came before has been yielded)."""
    body = _Inflater(source)
    while True:
        kind, length = _FRAME.unpack(body.read(_FRAME.size))
        if length > MAX_FRAME_BYTES:
            raise RecordingError(f"corrupt recording: a frame of {length} bytes")
        payload = body.read(length)
        if kind == Kind.END:
            try:
                msgspec.msgpack.decode(payload, type=Trailer)
            except msgspec.DecodeError as exc:
                raise RecordingError(f"corrupt recording trailer: {exc}") from None
            if not body.finished():
                raise RecordingError("corrupt recording: data after the end frame")
            return
        if kind not in Kind.__members__.values():
            continue  # a kind added after this reader: skipped by design
        try:
            yield Kind(kind), _entry_decoder.decode(payload)
        except msgspec.DecodeError as exc:
            raise RecordingError(f"corrupt recording: bad {Kind(kind).name} frame: {exc}"
                                 ) from None
