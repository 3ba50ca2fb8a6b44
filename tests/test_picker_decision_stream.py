"""The decision stream's publisher over a real nats-server: batching per window and pool,
heartbeats, the bounded queue."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from scheduling.record import DecisionRecord, RecordBatch
from scheduling.types import PodView
from services.picker.batch_sender import BatchSender
from services.picker.decision_stream import decision_queue, record_queue
from shared.schemas import Criticality, DecisionBatch, RoutedEvent, decode
from shared.subjects import Subjects
from tests.support.nats_sync import synced

POOL = "pool-1"


def routed(request_id: int, pod: str) -> RoutedEvent:
    return RoutedEvent(request_id, pod, "m", Criticality.STANDARD)


async def test_decisions_of_one_window_go_out_as_one_message_per_pool(nc: Client) -> None:
    subjects = Subjects()
    received: list[DecisionBatch] = []
    subscriptions = [await nc.subscribe(subjects.decisions(pool), cb=_collector(received))
                     for pool in (POOL, "other")]
    published: list[int] = []
    sender = BatchSender("me", delay=0.005, heartbeat=60)
    publisher = decision_queue(sender, subjects, on_published=published.append)
    task = asyncio.create_task(sender.run(nc))
    try:
        for request_id in range(100):
            publisher(POOL, routed(request_id, "pod-a"))
        publisher("other", routed(1000, "pod-b"))
        await _wait_for(lambda: sum(published) == 101)  # every event went out
        await synced(nc)  # and whatever carried them is back on this connection
        assert sum(subscription.delivered for subscription in subscriptions) == 2
        await _wait_for(lambda: len(received) == 2)
    finally:
        task.cancel()
    by_pool = {b.pool: b for b in received}
    assert len(received) == 2 and set(by_pool) == {POOL, "other"}
    assert [e.request_id for e in by_pool[POOL].events] == list(range(100))
    assert by_pool[POOL].picker == "me" and sum(published) == 101


async def test_a_quiet_publisher_sends_heartbeats(nc: Client) -> None:
    subjects = Subjects()
    received: list[DecisionBatch] = []
    await nc.subscribe(subjects.decisions(POOL), cb=_collector(received))
    sender = BatchSender("me", delay=0.001, heartbeat=0.1)
    publisher = decision_queue(sender, subjects)
    task = asyncio.create_task(sender.run(nc))
    try:
        publisher(POOL, routed(1, "pod-a"))
        await _wait_for(lambda: len(received) >= 4, within=3)
    finally:
        task.cancel()
    assert received[0].events and all(not b.events for b in received[1:4])
    assert all(b.heartbeat_s == 0.1 for b in received)


async def test_the_queue_is_bounded_and_drops_while_nats_is_away(nc: Client) -> None:
    dropped: dict[str, int] = {}
    sender = BatchSender("me")
    publisher = decision_queue(sender, Subjects(), max_pending=10,
                               on_dropped=lambda reason, n: dropped.update(
                                   {reason: dropped.get(reason, 0) + n}))
    for request_id in range(25):
        publisher(POOL, routed(request_id, "pod-a"))
    await nc.close()
    await sender.flush(nc)
    assert dropped == {"queue_full": 15, "nats_away": 10}
    assert publisher.take() == {}


def _collector(received: list[DecisionBatch]) -> Callable[[Msg], Awaitable[None]]:
    async def on_message(message: Msg) -> None:
        received.append(decode(message.data, DecisionBatch))

    return on_message


async def _wait_for(condition: Callable[[], bool], within: float = 2.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("condition not met in time")
        await asyncio.sleep(0.005)


def _record(request_id: str, pods: int) -> DecisionRecord:
    view = tuple(PodView(f"pod-{index:05d}", f"10.0.{index // 250}.{index % 250}:8000", index)
                 for index in range(pods))
    return DecisionRecord(request_id, 1, 1, "m", "m", Criticality.STANDARD, 0, 0, 0, {},
                          "filter-tree", 5, view, "pod-00000")


async def test_records_share_the_sender_and_split_to_fit_the_servers_max_payload(
        nc: Client) -> None:
    subjects = Subjects()
    received: list[RecordBatch] = []

    async def on_message(message: Msg) -> None:
        received.append(decode(message.data, RecordBatch))

    await nc.subscribe(subjects.records(POOL), cb=on_message)
    dropped: dict[str, int] = {}
    published: list[int] = []
    sender = BatchSender("me", delay=0.001, heartbeat=60)
    decisions = decision_queue(sender, subjects)
    records = record_queue(sender, subjects, on_published=published.append,
                           on_dropped=lambda reason, n: dropped.update({reason: n}))
    big = [_record(f"r{number}", 1_000) for number in range(40)]  # ~40 KB each
    for record in big:
        records(POOL, record)
    records(POOL, _record("huge", 40_000))  # alone beyond 1 MB
    decisions(POOL, routed(1, "pod-a"))
    await sender.flush(nc)
    await _wait_for(lambda: sum(len(batch.records) for batch in received) >= 40)
    assert len(received) >= 2 and all(batch.picker == "me" for batch in received)
    assert [record.request_id for batch in received for record in batch.records] == [
        record.request_id for record in big]
    assert sum(published) == 40 and dropped == {"too_large": 1}
    assert received[0].records[0] == big[0]
