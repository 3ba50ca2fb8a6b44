"""The recorder's pure logic: the file format's framing and forward compatibility, the export
window flags, and the registry as of a time from the bucket and its sourced recording."""

from __future__ import annotations

import io
import os
import struct
import zlib

import msgspec
import pytest

from recording.fileformat import (
    FORMAT_VERSION,
    MAGIC,
    READ_CHUNK,
    Entry,
    FileHeader,
    Kind,
    RecordingError,
    Writer,
    read_entries,
    read_header,
)
from recording.registry_history import Revision, changes_in, join, revision, state_at
from recording.streams import Delivery, Stored, delivery_fields
from recording.window import Window, parse_duration, parse_time, window_from

HEADER = FileHeader(created_ns=5, from_ns=10, to_ns=20, prefix="lig", pool="p", source="host")


def test_a_file_reads_back_frame_for_frame_and_skips_kinds_added_later() -> None:
    out = io.BytesIO()
    writer = Writer(out, HEADER)
    writer.add(Kind.REGISTRY_STATE, Entry(1, "pool.p", b"pool"))
    writer._frame(9, b"a record kind this reader does not know")  # type: ignore[arg-type]
    writer.add(Kind.REGISTRY_CHANGE, Entry(12, "endpoints.p", None))
    writer.add(Kind.SNAPSHOT, Entry(13, "metrics.p.a", b"\x00" * 1000))
    writer.close()
    source = io.BytesIO(out.getvalue())
    assert read_header(source) == HEADER
    assert list(read_entries(source)) == [
        (Kind.REGISTRY_STATE, Entry(1, "pool.p", b"pool")),
        (Kind.REGISTRY_CHANGE, Entry(12, "endpoints.p", None)),
        (Kind.SNAPSHOT, Entry(13, "metrics.p.a", b"\x00" * 1000)),
    ]
    assert writer.counts == {"registry_state": 1, "registry_change": 1, "snapshot": 1}
    assert FORMAT_VERSION == 1


def test_a_file_without_its_end_frame_is_truncated() -> None:
    # Built by hand from docs/recording.md: a complete zlib body whose last frame is not END.
    header = msgspec.msgpack.encode(HEADER)
    payload = msgspec.msgpack.encode(Entry(13, "metrics.p.a", b"x"))
    body = zlib.compress(struct.pack(">BI", Kind.SNAPSHOT, len(payload)) + payload)
    source = io.BytesIO(MAGIC + struct.pack(">HI", 1, len(header)) + header + body)
    assert read_header(source) == HEADER
    entries = read_entries(source)
    assert next(entries) == (Kind.SNAPSHOT, Entry(13, "metrics.p.a", b"x"))
    with pytest.raises(RecordingError, match="truncated"):
        next(entries)


def test_window_flags() -> None:
    now = 1_000 * 10**9
    assert parse_duration("90") == parse_duration("90s") == parse_duration("1.5m") == 90.0
    assert parse_duration("2h") == 7200.0 and parse_duration("250ms") == 0.25
    assert parse_time("1700000000.5") == 1_700_000_000_500_000_000
    assert parse_time("2023-11-14T22:13:20Z") == parse_time("2023-11-14T22:13:20") \
        == parse_time("2023-11-14T23:13:20+01:00") == 1_700_000_000 * 10**9
    assert window_from(None, None, None, now) == Window(now - 600 * 10**9, now)
    assert window_from("10s", None, None, now) == Window(now - 10 * 10**9, now)
    assert window_from(None, "900", "950", now) == Window(900 * 10**9, 950 * 10**9)
    for since, start, end in (("1m", "900", None), (None, "950", "900"), ("ten", None, None),
                              (None, "yesterday", None)):
        with pytest.raises(ValueError):
            window_from(since, start, end, now)


def test_delivery_fields_from_both_reply_subject_versions() -> None:
    expected = Delivery(stream_seq=42, consumer_seq=7, time_ns=1700000000123456789, pending=3)
    assert delivery_fields("$JS.ACK.S.C.1.42.7.1700000000123456789.3") == expected
    assert delivery_fields("$JS.ACK.dom.hash.S.C.1.42.7.1700000000123456789.3.rnd") == expected


def _stored(seq: int, time_ns: int, key: str, data: bytes, headers: dict[str, str] | None = None
            ) -> Stored:
    return Stored(seq, time_ns, f"$KV.lig-registry.{key}", headers, data)


def test_registry_at_the_window_start_joins_the_bucket_and_its_recording() -> None:
    bucket = "lig-registry"
    # The bucket kept only the newest revision of pool.p (seq 9) and endpoints.p (seq 7); the
    # recording (sourced, copied later) kept seq 5..9 but forgot pool.p's first write (seq 1).
    from_bucket = [revision(_stored(7, 70, "endpoints.p", b"e2"), bucket, sourced=False),
                   revision(_stored(9, 90, "pool.p", b"p2"), bucket, sourced=False)]
    sourced = [revision(_stored(n, 1000 + n, key, data, {
        "Nats-Stream-Source": f"KV_{bucket} {n} > > $KV.{bucket}.{key}",
        **({"KV-Operation": "DEL"} if data == b"" else {})}), bucket, sourced=True)
               for n, key, data in ((5, "endpoints.p", b"e1"), (6, "model.p.m", b"m1"),
                                    (7, "endpoints.p", b"e2"), (8, "model.p.m", b""),
                                    (9, "pool.p", b"p2"))]
    assert revision(Stored(1, 1, "$KV.other.pool.p", None, b""), bucket, sourced=False) is None
    joined = join([item for item in (*from_bucket, *sourced) if item is not None])
    assert [(item.bucket_seq, item.time_ns) for item in joined] == \
        [(5, 1005), (6, 1006), (7, 70), (8, 1008), (9, 90)]  # the bucket's own times win
    assert state_at(joined, 80) == [Revision(7, 70, "endpoints.p", b"e2")]
    assert state_at(joined, 1010) == [Revision(7, 70, "endpoints.p", b"e2"),
                                      Revision(9, 90, "pool.p", b"p2")]  # model deleted
    assert [item.bucket_seq for item in changes_in(joined, 80, 1007)] == [5, 6, 9]


class _CountingReads(io.BytesIO):
    """A file that remembers the largest single read."""

    largest = 0

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self.largest = max(self.largest, len(data))
        return data


def test_a_recording_is_read_in_bounded_chunks_not_whole() -> None:
    out = io.BytesIO()
    writer = Writer(out, HEADER)
    for i in range(2_000):  # ~8 MB of incompressible snapshots
        writer.add(Kind.SNAPSHOT, Entry(i, "metrics.p.a", os.urandom(4096)))
    writer.close()
    source = _CountingReads(out.getvalue())
    read_header(source)
    entries = read_entries(source)
    next(entries)
    assert source.tell() <= 2 * READ_CHUNK  # one entry needed one chunk or two, not the file
    assert sum(1 for _ in entries) == 1_999
    assert source.largest <= READ_CHUNK
