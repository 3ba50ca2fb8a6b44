"""The picker's pod table: newest snapshot per pod, staleness, in-flight counts (no network)."""

from __future__ import annotations

import random
from collections import Counter

import msgspec
import pytest

from scheduling import SchedulingRequest, build_policy
from services.picker.gray_pods import GrayPods
from services.picker.metrics_feed import SnapshotSink
from services.picker.state import PodTable
from shared.schemas import Endpoint, PodMetrics, PolicyConfig, encode

ENDPOINTS = [Endpoint("pod-a", "10.0.0.1", 8000), Endpoint("pod-b", "10.0.0.2", 8000)]
ADDRESSES = {endpoint.name: endpoint.hostport for endpoint in ENDPOINTS}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def snapshot(pod: str, seq: int, scrape_time_ns: int = 0, ok: bool = True,
             address: str | None = None, **fields: object) -> PodMetrics:
    address = address or ADDRESSES.get(pod, "10.9.9.9:8000")
    return PodMetrics(pool="p", pod=pod, address=address, seq=seq,
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


def test_stale_pods_with_requests_in_flight_give_no_views(table: PodTable,
                                                          clock: FakeClock) -> None:
    table.apply(snapshot("pod-a", 1))
    table.started("pod-a")
    clock.now += 2.0
    assert table.fresh_views() == []


def test_failed_scrape_is_not_fresh(table: PodTable) -> None:
    table.apply(snapshot("pod-a", 1, waiting=0))
    table.apply(snapshot("pod-a", 2, ok=False))
    assert table.fresh_views() == []


def test_non_members_are_ignored_and_pruned(table: PodTable) -> None:
    table.apply(snapshot("pod-z", 1, address="10.0.0.9:9000"))
    assert table.fresh_views() == []
    assert not table.has_member_snapshot()
    table.set_endpoints([*ENDPOINTS, Endpoint("pod-z", "10.0.0.9", 9000)])
    assert [v.address for v in table.fresh_views()] == ["10.0.0.9:9000"]
    table.set_endpoints(ENDPOINTS)
    assert table.fresh_views() == []


def test_snapshot_for_another_address_is_dropped_and_counted(table: PodTable) -> None:
    wrong: list[int] = []
    sink = SnapshotSink({"p": table}.get, on_wrong_address=lambda: wrong.append(1))
    sink.accept("lig.metrics.p.pod-a", encode(snapshot("pod-a", 1, waiting=40)))
    # A forged (or stale) snapshot naming pod-a but another address: it must not make the
    # registered pod-a look idle.
    sink.accept("lig.metrics.p.pod-a", encode(snapshot("pod-a", 2, waiting=0,
                                                       address="10.6.6.6:8000")))
    assert wrong == [1]
    assert [(v.name, v.waiting) for v in table.fresh_views()] == [("pod-a", 40)]


def test_early_snapshot_for_another_address_is_forgotten_when_the_pod_is_registered(
    table: PodTable,
) -> None:
    table.apply(snapshot("pod-z", 1, address="10.6.6.6:8000"))
    table.set_endpoints([*ENDPOINTS, Endpoint("pod-z", "10.0.0.9", 9000)])
    assert table.fresh_views() == []
    # A pod moved to a new address: its old snapshots no longer describe it.
    table.apply(snapshot("pod-a", 1))
    table.set_endpoints([Endpoint("pod-a", "10.0.0.5", 8000)])
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
    sink = SnapshotSink({"p": table}.get, on_undecodable=lambda: bad.append(1),
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


def test_requests_sent_since_the_newest_snapshot_are_added_to_waiting(table: PodTable) -> None:
    table.apply(snapshot("pod-a", 1, waiting=2))
    table.apply(snapshot("pod-b", 1, waiting=2))
    table.started("pod-a")
    table.started("pod-a")
    table.finished("pod-a")  # ended or not, it is not in the snapshot yet
    views = {view.name: view for view in table.fresh_views()}
    assert (views["pod-a"].waiting, views["pod-a"].in_flight) == (4, 1)
    assert (views["pod-b"].waiting, views["pod-b"].in_flight) == (2, 0)


def test_only_requests_beyond_the_least_served_pod_count_as_queue(table: PodTable) -> None:
    """Requests spread evenly are mostly running: they must not lift every pod's queue."""
    table.apply(snapshot("pod-a", 1, waiting=2))
    table.apply(snapshot("pod-b", 1, waiting=5))
    for pod in ["pod-a", "pod-b", "pod-a", "pod-b", "pod-a"]:
        table.started(pod)
    assert [view.waiting for view in table.fresh_views()] == [3, 5]


def test_a_newer_snapshot_replaces_the_estimate(table: PodTable) -> None:
    table.apply(snapshot("pod-a", 1, waiting=0))
    table.apply(snapshot("pod-b", 1, waiting=0))
    table.started("pod-a")
    table.started("pod-a")
    assert table.apply(snapshot("pod-a", 2, waiting=1))
    views = table.fresh_views()
    assert [(view.waiting, view.in_flight) for view in views] == [(1, 2), (0, 0)]
    table.started("pod-a")
    assert table.fresh_views()[0].waiting == 2


def test_an_out_of_order_snapshot_keeps_the_estimate(table: PodTable) -> None:
    table.apply(snapshot("pod-a", 5, waiting=1))
    table.apply(snapshot("pod-b", 5, waiting=1))
    table.started("pod-a")
    assert not table.apply(snapshot("pod-a", 4, waiting=0))
    assert not table.apply(snapshot("pod-a", 5, waiting=0))
    assert [view.waiting for view in table.fresh_views()] == [2, 1]


def test_the_estimate_can_be_turned_off(clock: FakeClock) -> None:
    table = PodTable(stale_after=1.0, clock=clock, load_estimate=False)
    table.set_endpoints(ENDPOINTS)
    table.apply(snapshot("pod-a", 1, waiting=3))
    table.apply(snapshot("pod-b", 1, waiting=3))
    table.started("pod-a")
    views = table.fresh_views()
    assert [(view.waiting, view.in_flight) for view in views] == [(3, 1), (3, 0)]


@pytest.mark.parametrize(("load_estimate", "spread"), [(True, [2, 2, 2, 2]), (False, [8])])
def test_the_estimate_spreads_one_scrape_interval_over_the_pods(
    clock: FakeClock, load_estimate: bool, spread: list[int]
) -> None:
    """Idle pods whose KV usage differs a little: on the snapshots alone the filter tree's
    least-KV band keeps only the lowest, so every request until the next scrape goes there."""
    table = PodTable(stale_after=1.0, clock=clock, load_estimate=load_estimate)
    names = ["p0", "p1", "p2", "p3"]
    table.set_endpoints([Endpoint(name, "10.0.0.1", 8000 + i) for i, name in enumerate(names)])
    for i, name in enumerate(names):
        table.apply(snapshot(name, 1, kv_cache_usage=0.10 + 0.01 * i))
    policy = build_policy(PolicyConfig(name="filter-tree"), random.Random(3))
    request = SchedulingRequest("m", "m")
    sent: Counter[str] = Counter()
    for _ in range(8):
        pick = policy.schedule(request, table.fresh_views()).pick
        assert pick is not None
        table.started(pick.name)
        sent[pick.name] += 1
    assert sorted(sent.values()) == spread


def test_requests_newer_than_the_snapshot_do_not_make_a_pod_gray(clock: FakeClock) -> None:
    """With --stale-after above --gray-after, a snapshot can be older than requests that are
    already "old": the pod could not have counted them, so they must not make it gray."""
    table = PodTable(stale_after=5.0, clock=clock, gray=GrayPods(gray_after=2.0, sample_every=0))
    table.set_endpoints(ENDPOINTS)
    table.apply(snapshot("pod-a", 1))  # idle, as it was before the requests
    table.apply(snapshot("pod-b", 1))
    clock.now += 0.5
    for _ in range(3):  # long generations, running at pod-a from now on
        table.started("pod-a")
    clock.now += 2.5  # the requests are 2.5 s old; the snapshots, 3 s old, are still fresh
    assert {view.name for view in table.fresh_views()} == {"pod-a", "pod-b"}
    table.apply(snapshot("pod-a", 2, running=3))  # the pod runs them: still fine
    table.apply(snapshot("pod-b", 2))
    clock.now += 2.5
    assert {view.name for view in table.fresh_views()} == {"pod-a", "pod-b"}
    table.apply(snapshot("pod-a", 3))  # a newer snapshot without them: now it is gray
    assert {view.name for view in table.fresh_views()} == {"pod-b"}
