"""The registry as of a time, and its changes in a window, from the bucket's own stream and
the registry recording that sources it.

The bucket (``KV_<prefix>-registry``) keeps the last few revisions of each key and no age
limit; the recording (``LIG_REGISTRY``) keeps every change for the recording's age but may have
forgotten a key written long ago. Both are read and joined on the bucket's sequence number (a
sourced copy names it in its ``Nats-Stream-Source`` header), so the state at the window start
is right even when the last write of a key is older than the recording.
"""

from __future__ import annotations

import msgspec

from recording.streams import Stored

SOURCE_HEADER = "Nats-Stream-Source"
OPERATION_HEADER = "KV-Operation"


class Revision(msgspec.Struct, frozen=True):
    """One write of a registry key: ``data`` None is a delete or purge."""

    bucket_seq: int
    time_ns: int
    key: str
    data: bytes | None


def revision(message: Stored, bucket: str, sourced: bool) -> Revision | None:
    """The registry revision a stored message is; None when it is not one of ``bucket``."""
    head = f"$KV.{bucket}."
    if not message.subject.startswith(head):
        return None
    headers = message.headers or {}
    seq = message.seq
    if sourced:
        origin = headers.get(SOURCE_HEADER, "").split()
        if len(origin) < 2 or not origin[1].isdigit():
            return None
        seq = int(origin[1])
    deleted = headers.get(OPERATION_HEADER) in ("DEL", "PURGE")
    return Revision(seq, message.time_ns, message.subject[len(head):],
                    None if deleted else message.data)


def join(revisions: list[Revision]) -> list[Revision]:
    """One revision per bucket sequence, in write order. A revision read from the bucket itself
    carries the original write time; a sourced copy only the time it was copied, so the first
    one given wins: pass the bucket's revisions first."""
    by_seq: dict[int, Revision] = {}
    for item in revisions:
        by_seq.setdefault(item.bucket_seq, item)
    return [by_seq[seq] for seq in sorted(by_seq)]


def state_at(revisions: list[Revision], time_ns: int) -> list[Revision]:
    """Each key's newest revision written at or before ``time_ns``, deleted keys left out."""
    latest: dict[str, Revision] = {}
    for item in revisions:
        if item.time_ns <= time_ns:
            latest[item.key] = item
    return [item for item in latest.values() if item.data is not None]


def changes_in(revisions: list[Revision], from_ns: int, to_ns: int) -> list[Revision]:
    """The revisions written in ``(from_ns, to_ns]``, in write order."""
    return [item for item in revisions if from_ns < item.time_ns <= to_ns]
