"""The picker's pod table: newest snapshot per pod, staleness, in-flight counts (no network)."""

from __future__ import annotations

import msgspec
import pytest

from services.picker.metrics_feed import SnapshotSink
from services.picker.state import PodTable
from shared.schemas import Endpoint, PodMetrics, encode

ENDPOINTS = [Endpoint("pod-a", "10.0.0.1", 8000), Endpoint("pod-b", "10.0.0.2", 8000)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def snapshot(pod: str, seq: int, scrape_time_ns: int = 0, ok: bool = True,
             **fields: object) -> PodMetrics:
    return PodMetrics(pool="p", pod=pod, address="ignored:1", seq=seq,
                      scrape_time_ns=scrape_time_ns or seq * 1_000_000, scrape_duration_s=0.01,
                      ok=ok, error=None if ok else "timeout", **fields)  # type: ignore[arg-type]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def table(clock: FakeClock) -> PodTable:
    table = PodTable(stale_after=1.0, clock=clock)
    table.set_endpoints(ENDPOINTS)
    return table


def test_views_carry_newest_metrics_and_registry_address(table: PodTable) -> None:
    assert table.apply(snapshot("pod-a", 1, waiting=3, running_adapters=("sql",), max_lora=4))
    assert table.apply(snapshot("pod-a", 2, waiting=7))
    (view,) = table.fresh_views()
    assert (view.name, view.address, view.waiting, view.running_adapters) == (
        "pod-a", "10.0.0.1:8000", 7, frozenset())


def test_out_of_order_snapshot_is_dropped(table: PodTable) -> None:
    table.apply(snapshot("pod-a", 5, waiting=1))
    assert not table.apply(snapshot("pod-a", 4, waiting=99))
    assert not table.apply(snapshot("pod-a", 5, waiting=99))
    assert table.fresh_views()[0].waiting == 1


def test_restarted_sequence_with_newer_scrape_time_is_taken(table: PodTable) -> None:
    table.apply(snapshot("pod-a", 500, scrape_time_ns=10_000, waiting=1))
    assert table.apply(snapshot("pod-a", 1, scrape_time_ns=20_000, waiting=2))
    assert table.fresh_views()[0].waiting == 2


def test_snapshot_goes_stale_after_the_limit(table: PodTable, clock: FakeClock) -> None:
    table.apply(snapshot("pod-a", 1))
    clock.now += 0.9
    table.apply(snapshot("pod-b", 1))
    assert [v.name for v in table.fresh_views()] == ["pod-a", "pod-b"]
    clock.now += 0.2
    assert [v.name for v in table.fresh_views()] == ["pod-b"]
    freshness = table.freshness(wall_clock_ns=10_000_000)
    assert (freshness.fresh, freshness.stale) == (1, 1)


def test_failed_scrape_is_not_fresh(table: PodTable) -> None:
    table.apply(snapshot("pod-a", 1, waiting=0))
    table.apply(snapshot("pod-a", 2, ok=False))
    assert table.fresh_views() == []


def test_non_members_are_ignored_and_pruned(table: PodTable) -> None:
    table.apply(snapshot("pod-z", 1))
    assert table.fresh_views() == []
    assert not table.has_member_snapshot()
    table.set_endpoints([*ENDPOINTS, Endpoint("pod-z", "10.0.0.9", 9000)])
    assert [v.address for v in table.fresh_views()] == ["10.0.0.9:9000"]
    table.set_endpoints(ENDPOINTS)
    assert table.fresh_views() == []


def test_in_flight_counts_reach_the_views(table: PodTable) -> None:
    table.apply(snapshot("pod-a", 1))
    table.started("pod-a")
    table.started("pod-a")
    table.finished("pod-a")
    assert table.fresh_views()[0].in_flight == 1
    table.finished("pod-a")
    table.finished("pod-a")  # a double finish never goes negative
    assert table.fresh_views()[0].in_flight == 0
    assert table.in_flight() == {}


def test_snapshot_sink_counts_bad_payloads(table: PodTable) -> None:
    bad: list[int] = []
    late: list[int] = []
    sink = SnapshotSink("p", table, on_undecodable=lambda: bad.append(1),
                        on_out_of_order=lambda: late.append(1))
    sink.accept("lig.metrics.p.pod-a", b"\x93garbage")
    sink.accept("lig.metrics.p.pod-a", encode(msgspec.structs.replace(snapshot("pod-a", 1),
                                                                      schema=99)))
    sink.accept("lig.metrics.q.pod-a", encode(msgspec.structs.replace(snapshot("pod-a", 1),
                                                                      pool="q")))
    sink.accept("lig.metrics.p.pod-a", encode(snapshot("pod-a", 2)))
    sink.accept("lig.metrics.p.pod-a", encode(snapshot("pod-a", 1)))
    assert (len(bad), len(late)) == (3, 1)
    assert [v.name for v in table.fresh_views()] == ["pod-a"]


def test_pod_without_lora_info_gets_the_pools_reported_capacity(table: PodTable) -> None:
    table.apply(snapshot("pod-a", 1, max_lora=4, running_adapters=("sql",)))
    table.apply(snapshot("pod-b", 1))  # idle vLLM: no lora_requests_info series yet
    views = {view.name: view for view in table.fresh_views()}
    assert views["pod-b"].max_lora == 4
    assert views["pod-a"].max_lora == 4


def test_pool_without_lora_keeps_zero_capacity(table: PodTable) -> None:
    table.apply(snapshot("pod-a", 1))
    table.apply(snapshot("pod-b", 1, max_lora=0))
    assert [view.max_lora for view in table.fresh_views()] == [0, 0]
