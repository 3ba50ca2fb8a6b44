"""The collector's pure logic: ownership, backoff, the live set, targets, scheduling, flags."""

from __future__ import annotations

import argparse
import asyncio
import time

import pytest

from services.collector.main import configure, settings_from
from services.collector.membership import LiveSet
from services.collector.ownership import owned_by, owner
from services.collector.pod_loop import Cadence, first_seq
from services.collector.scrape_supervisor import ScrapeSupervisor
from services.collector.scraper import snapshot_from
from services.collector.targets import ScrapeTarget, metrics_url, pod_key, targets_from_view
from shared.registry_view import RegistryView
from shared.schemas import CollectorHeartbeat, Endpoint, EndpointSet, InferencePool, encode
from shared.subjects import Subjects, endpoints_key, pool_key
from shared.vllm_metrics import ParsedMetrics
from tests.support.waiting import eventually

PODS = {f"pool.pod-{i}": i for i in range(1000)}


def test_owner_is_deterministic_and_a_member() -> None:
    collectors = ["c1", "c2", "c3"]
    for key in list(PODS)[:50]:
        assert owner(key, collectors) in collectors
        assert owner(key, collectors) == owner(key, list(reversed(collectors)))


def test_pods_spread_evenly() -> None:
    collectors = [f"collector-{i}" for i in range(4)]
    counts = [len(owned_by(c, PODS, collectors)) for c in collectors]
    assert sum(counts) == len(PODS)
    assert all(200 <= count <= 300 for count in counts), counts


def test_a_joiner_takes_pods_only_from_others_and_a_leaver_gives_only_its_own() -> None:
    before = {key: owner(key, ["a", "b", "c"]) for key in PODS}
    after_join = {key: owner(key, ["a", "b", "c", "d"]) for key in PODS}
    moved = {key for key in PODS if before[key] != after_join[key]}
    assert moved and all(after_join[key] == "d" for key in moved)
    assert 150 <= len(moved) <= 350  # about a quarter

    after_leave = {key: owner(key, ["a", "c"]) for key in PODS}
    moved = {key for key in PODS if before[key] != after_leave[key]}
    assert moved == {key for key in PODS if before[key] == "b"}


def test_owned_by_counts_me_even_when_absent_from_the_set() -> None:
    assert owned_by("me", PODS, []) == PODS
    with pytest.raises(ValueError):
        owner("x", [])


def test_backoff_doubles_from_the_interval_up_to_the_cap() -> None:
    cadence = Cadence(interval_s=0.05, max_backoff_s=1.0)
    assert [cadence.delay_after(n) for n in range(7)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert cadence.delay_after(10_000) == 1.0
    assert Cadence(interval_s=2.0, max_backoff_s=1.0).delay_after(3) == 2.0


def test_sequence_starts_above_any_earlier_loop_of_the_pod() -> None:
    earlier = first_seq()
    time.sleep(0.02)  # an earlier loop scraping every millisecond would now be at earlier + 20
    assert first_seq() >= earlier + 20


def _beat(collector_id: str, active: bool = True, leaving: bool = False) -> CollectorHeartbeat:
    return CollectorHeartbeat(collector_id=collector_id, interval_s=1.0, active=active,
                              leaving=leaving)


def test_live_set_counts_peers_once_active_and_expires_silent_ones() -> None:
    live = LiveSet("me")
    assert live.heard(_beat("b", active=False), now=0.0) == (False, True)
    assert live.members() == {"me"}
    assert live.heard(_beat("b"), now=0.5) == (True, False)
    assert live.members() == {"me", "b"}
    assert live.heard(_beat("b"), now=1.0) == (False, False)
    assert live.expire(now=2.4) == []
    assert live.expire(now=2.5) == ["b"]  # 1.5 intervals after the last heartbeat
    assert live.members() == {"me"}


def test_live_set_drops_a_leaver_at_once_and_ignores_inactive_expiry() -> None:
    live = LiveSet("me")
    live.heard(_beat("b"), now=0.0)
    live.heard(_beat("c", active=False), now=0.0)
    assert live.heard(_beat("b", leaving=True), now=0.1) == (True, False)
    assert live.members() == {"me"}
    assert live.expire(now=10.0) == []  # c never owned anything


def test_a_peer_with_a_nonsensical_interval_expires_at_the_next_check() -> None:
    live = LiveSet("me")
    live.heard(CollectorHeartbeat(collector_id="b", interval_s=float("nan")), now=0.0)
    assert live.expire(now=0.0) == ["b"]


def test_grace_after_reconnect_postpones_expiry() -> None:
    live = LiveSet("me")
    live.heard(_beat("b"), now=0.0)
    live.grace(now=5.0)
    assert live.expire(now=6.0) == []
    assert live.expire(now=6.5) == ["b"]


def test_metrics_url_uses_pool_port_and_path_else_the_endpoint_port() -> None:
    endpoint = Endpoint("pod", "10.0.0.1", 8000)
    assert metrics_url(endpoint, None) == "http://10.0.0.1:8000/metrics"
    pool = InferencePool(name="p", target_port=8000, metrics_path="stats", metrics_port=9400)
    assert metrics_url(endpoint, pool) == "http://10.0.0.1:9400/stats"
    pool = InferencePool(name="p", target_port=8000, metrics_path="/m")
    assert metrics_url(Endpoint("pod", "fd00::1", 8001), pool) == "http://[fd00::1]:8001/m"


def test_targets_from_view_cover_every_pool_with_distinct_keys() -> None:
    view = RegistryView()
    view.apply(pool_key("a.b"), encode(InferencePool(name="a.b", target_port=8000)))
    view.apply(endpoints_key("a.b"), encode(EndpointSet(pool="a.b", endpoints=(
        Endpoint("c", "127.0.0.1", 8000),))))
    view.apply(endpoints_key("a"), encode(EndpointSet(pool="a", endpoints=(
        Endpoint("b.c", "127.0.0.1", 8001),))))
    targets = targets_from_view(view, Subjects("lig"))
    assert set(targets) == {pod_key("a.b", "c"), pod_key("a", "b.c")}
    target = targets[pod_key("a", "b.c")]
    assert target.address == "127.0.0.1:8001"
    assert target.url == "http://127.0.0.1:8001/metrics"
    assert target.subject == Subjects("lig").metrics("a", "b.c")


def _target(name: str, url: str = "http://127.0.0.1:1/metrics") -> ScrapeTarget:
    return ScrapeTarget(pool="p", pod=name, address="127.0.0.1:1", url=url, subject=f"s.{name}")


def test_snapshot_from_a_page_with_missing_families_keeps_defaults() -> None:
    parsed = ParsedMetrics(waiting=3, running=None, kv_cache_usage=None, running_adapters=None,
                           waiting_adapters=None, max_lora=None, block_size=None,
                           num_gpu_blocks=None, missing=("vllm:num_requests_running",))
    snapshot = snapshot_from(_target("x"), 7, 123, 0.01, parsed)
    assert (snapshot.ok, snapshot.waiting, snapshot.running, snapshot.kv_cache_usage) == (
        True, 3, 0, 0.0)
    assert snapshot.running_adapters == () and snapshot.max_lora is None
    assert snapshot.missing == ("vllm:num_requests_running",)
    assert (snapshot.seq, snapshot.scrape_time_ns, snapshot.address) == (7, 123, "127.0.0.1:1")


async def test_scrape_supervisor_runs_one_loop_per_wanted_target_and_never_two_for_a_pod() -> None:
    events: list[tuple[str, str]] = []
    running: dict[str, int] = {}

    async def loop(target: ScrapeTarget) -> None:
        running[target.pod] = running.get(target.pod, 0) + 1
        assert running[target.pod] == 1, "two loops of one pod at once"
        events.append(("start", target.url))
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.01)  # an in-flight scrape finishing after the cancel
            running[target.pod] -= 1
            events.append(("end", target.url))

    def stopped(target: ScrapeTarget) -> None:
        events.append(("closed", target.url))

    supervisor = ScrapeSupervisor(loop, stopped=stopped)
    a, b = _target("a"), _target("b")
    supervisor.reconcile({"a": a, "b": b})
    await eventually(lambda: len(events) == 2)
    supervisor.reconcile({"a": a, "b": b})  # unchanged: nothing restarts
    await asyncio.sleep(0.05)
    assert len(events) == 2

    moved = _target("b", url="http://127.0.0.1:2/metrics")
    supervisor.reconcile({"b": moved})
    await eventually(lambda: ("start", moved.url) in events)
    old_b = [e for e in events if e[1] == b.url]
    assert old_b[-2:] == [("end", b.url), ("closed", b.url)]
    assert events.index(("closed", b.url)) < events.index(("start", moved.url))
    assert ("closed", a.url) in events
    assert set(supervisor.targets) == {"b"}

    await supervisor.stop()
    assert running == {"a": 0, "b": 0} and supervisor.targets == {}


async def test_scrape_supervisor_restarts_a_loop_that_crashed() -> None:
    starts = 0

    async def loop(target: ScrapeTarget) -> None:
        nonlocal starts
        starts += 1
        if starts == 1:
            raise RuntimeError("bug")
        await asyncio.Event().wait()

    supervisor = ScrapeSupervisor(loop, restart_delay_s=0.01)
    supervisor.reconcile({"a": _target("a")})
    await eventually(lambda: starts == 2)
    await supervisor.stop()


def _parse_flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(list(argv))


def test_flag_defaults_and_validation() -> None:
    settings = settings_from(_parse_flags())
    assert (settings.interval_s, settings.metrics_port, settings.record_max_age_s,
            settings.heartbeat_s) == (0.05, 9091, 3600.0, 1.0)
    assert settings.timeout_s == pytest.approx(0.04)
    assert settings_from(_parse_flags("--interval", "1", "--scrape-timeout", "0.5")) \
        .scrape_timeout_s == 0.5
    for bad in (["--scrape-timeout", "0.06"], ["--interval", "0.001"], ["--heartbeat", "0"],
                ["--record-max-age", "-1"]):
        with pytest.raises(ValueError):
            settings_from(_parse_flags(*bad))
