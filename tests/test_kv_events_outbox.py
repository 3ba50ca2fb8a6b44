"""``lig kv-events`` while NATS is away and when it resumes: the outbox's bound and order, the
publisher's numbering, and where a stream resumes from its recording (no network)."""

from __future__ import annotations

import msgspec
import pytest

from services.kvevents.observability import KVEventsMetrics
from services.kvevents.outbox import Outbox
from services.kvevents.publisher import BlockPublisher
from services.kvevents.sequencing import ResumePoint, SequenceTracker, resume_point
from shared import kv_blocks
from shared.kv_blocks import KVBlockChanges, marker
from shared.kv_events import AllBlocksCleared, BlockRemoved
from shared.subjects import Subjects


def change(pod: str, seq: int, rank: int = 0, hashes: int = 1) -> KVBlockChanges:
    return KVBlockChanges("pool", pod, f"{pod}:8000", seq, float(seq),
                          [BlockRemoved(tuple(range(hashes)), "GPU")], rank)


def drain(outbox: Outbox) -> list[KVBlockChanges]:
    out = []
    while (next_change := outbox.peek()) is not None:
        out.append(next_change)
        outbox.pop()
    return out


def test_held_changes_leave_in_order_per_pod_rank() -> None:
    outbox = Outbox(100, 1 << 20)
    puts = [change("a", 0), change("b", 0), change("a", 1), change("a", 0, rank=1),
            change("b", 1)]
    for c in puts:
        assert outbox.put(c, 10, 0.0) == []
    assert outbox.messages == 5 and outbox.bytes == 50
    out = drain(outbox)
    assert sorted(out, key=lambda c: (c.pod, c.dp_rank, c.source_seq)) == sorted(
        puts, key=lambda c: (c.pod, c.dp_rank, c.source_seq))
    for key in {(c.pod, c.dp_rank) for c in puts}:
        assert [c.source_seq for c in out if (c.pod, c.dp_rank) == key] == sorted(
            c.source_seq for c in puts if (c.pod, c.dp_rank) == key)
    assert not outbox and outbox.bytes == 0


def test_past_the_message_bound_the_largest_pod_becomes_one_resync_marker() -> None:
    outbox = Outbox(5, 1 << 20)
    outbox.put(change("quiet", 0), 10, 0.0)
    for seq in range(4):
        assert outbox.put(change("busy", seq), 10, 0.0) == []
    assert outbox.put(change("busy", 4), 10, 7.0) == [("pool", "busy", 0)]
    held = drain(outbox)
    assert held[0] == change("quiet", 0)  # the quiet pod keeps its exact changes
    busy = held[1]
    assert busy == marker("pool", "busy", "busy:8000", 0, 7.0, resync=True)
    assert busy.ops == [AllBlocksCleared()] and busy.resync and busy.source_seq == -1
    assert outbox.dropped == 5


def test_changes_after_the_marker_queue_behind_it_and_it_is_reported_once_per_outage() -> None:
    outbox = Outbox(3, 1 << 20)
    reported = [outbox.put(change("a", seq), 10, 0.0) for seq in range(8)]
    assert reported.count([("pool", "a", 0)]) == 1  # once, however often it collapses
    held = drain(outbox)
    assert held[0].resync and all(not c.resync for c in held[1:])
    assert [c.source_seq for c in held[1:]] == sorted(c.source_seq for c in held[1:])
    # The outage is over: the next one reports again.
    assert [outbox.put(change("a", seq), 10, 0.0) for seq in range(4)][-1] == [("pool", "a", 0)]


def test_the_byte_bound_counts_encoded_sizes() -> None:
    outbox = Outbox(1_000, 1_000)
    outbox.put(change("small", 0), 100, 0.0)
    assert outbox.put(change("big", 0), 950, 0.0) == [("pool", "big", 0)]
    assert outbox.bytes <= 1_000 and outbox.messages == 2
    small, big = drain(outbox)
    assert small == change("small", 0) and big.resync
    assert outbox.bytes == 0


def test_markers_alone_may_exceed_the_bound() -> None:
    outbox = Outbox(2, 1 << 20)
    for pod in "abcd":
        outbox.put(change(pod, 0), 10, 0.0)
    assert outbox.messages == 4 and all(c.resync for c in drain(outbox))


def test_a_recorded_batch_of_the_same_rank_and_address_is_resumed_from() -> None:
    recorded = msgspec.structs.replace(change("a", 41), stream_seq=99)
    assert resume_point(recorded, "a:8000", 0) == ResumePoint(100, (41, 41.0))


@pytest.mark.parametrize(("address", "rank"), [("b:8000", 0), ("a:8000", 1)])
def test_another_address_or_rank_says_nothing_of_this_stream(address: str, rank: int) -> None:
    assert resume_point(change("a", 41), address, rank) is None
    assert resume_point(None, "a:8000", 0) is None


def test_after_a_marker_the_numbering_continues_and_the_vllm_stream_starts_over() -> None:
    recorded = msgspec.structs.replace(
        marker("pool", "a", "a:8000", 0, 5.0, resync=True), stream_seq=12)
    assert resume_point(recorded, "a:8000", 0) == ResumePoint(13, None)


def test_a_message_of_an_older_bridge_decodes_unnumbered_and_numbering_starts_at_0() -> None:
    plain = msgspec.msgpack.decode(kv_blocks.encode(change("a", 3)))
    del plain["stream_seq"]  # what a bridge before stream_seq sent
    decoded = kv_blocks.decode(msgspec.msgpack.encode(plain))
    assert decoded.stream_seq == -1
    point = resume_point(decoded, "a:8000", 0)
    assert point is not None and point.next_stream_seq == 0 and point.last == (3, 3.0)


def test_a_resumed_tracker_asks_its_first_replay_from_the_recorded_batch() -> None:
    tracker = SequenceTracker()
    tracker.resume(41, 41.5)
    assert tracker.expected == 42 and tracker.last == (41, 41.5)
    assert tracker.same_engine((41, 41.5)) is True  # the buffer still covers it: no resync
    assert tracker.same_engine((41, 2.0)) is False  # another engine: restarted
    assert tracker.same_engine(None) is False
    assert tracker.same_engine((50, 50.0)) is None  # the buffer rolled over: resync


class FakeNats:
    """Just what the publisher uses of a client: ``is_connected`` and ``publish``."""

    def __init__(self) -> None:
        self.is_connected = True
        self.fail = False
        self.sent: list[KVBlockChanges] = []

    async def publish(self, subject: str, data: bytes) -> None:
        if self.fail:
            raise ConnectionError("gone")
        self.sent.append(kv_blocks.decode(data))


async def test_the_publisher_numbers_what_goes_out_and_holds_what_does_not() -> None:
    metrics = KVEventsMetrics()
    publisher = BlockPublisher(Subjects(), metrics, 3, 1 << 20)
    nc = FakeNats()
    publisher.attach(nc)  # type: ignore[arg-type]
    publisher.resume(("pool", "a", 0), 10)
    await publisher.publish(change("a", 0))
    nc.is_connected = False
    for seq in range(1, 3):
        await publisher.publish(change("a", seq))
    nc.is_connected, nc.fail = True, True  # connected, but the publish fails: held too
    await publisher.publish(change("b", 0))
    assert [c.source_seq for c in nc.sent] == [0] and publisher.outbox.messages == 3
    nc.fail = False
    await publisher.drain()
    await publisher.publish(change("a", 3))
    assert [(c.pod, c.source_seq, c.stream_seq) for c in nc.sent] == [
        ("a", 0, 10), ("a", 1, 11), ("a", 2, 12), ("b", 0, 0), ("a", 3, 13)]
    assert metrics.publish_errors._value.get() == 3
    assert metrics.published._value.get() == 5


async def test_a_pod_past_the_bound_publishes_one_marker_numbered_in_turn() -> None:
    metrics = KVEventsMetrics()
    publisher = BlockPublisher(Subjects(), metrics, 3, 1 << 20)
    nc = FakeNats()
    publisher.attach(nc)  # type: ignore[arg-type]
    await publisher.publish(change("a", 0))
    nc.is_connected = False
    for seq in range(1, 6):
        await publisher.publish(change("a", seq))
    nc.is_connected = True
    await publisher.publish(change("a", 6))  # finds NATS back: what is held goes first
    # 1..4 overflowed into the marker; 5 came after it and is kept.
    assert [(c.source_seq, c.resync, c.stream_seq) for c in nc.sent] == [
        (0, False, 0), (-1, True, 1), (5, False, 2), (6, False, 3)]
    assert metrics.buffer_overflows._value.get() == 1
    assert metrics.buffer_dropped._value.get() == 4
    assert metrics.resyncs._value.get() == 1
