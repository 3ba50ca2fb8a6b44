"""Issue 24: snapshots reconciled by time, near-ties by age, the least-work picker (no network)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from scheduling import SchedulingRequest, build_policy
from scheduling.params import PolicyConfigError
from scheduling.plugins.least_work import LeastWork, estimated_work
from scheduling.types import PodView
from services.picker.load_estimate import UnreportedLoad, picker_views
from services.picker.peer_decisions import PeerDecisions
from services.picker.routing import Router
from services.picker.state import PodTable
from shared.schemas import (
    Criticality,
    DecisionBatch,
    Endpoint,
    PodMetrics,
    PolicyConfig,
    RoutedEvent,
)

REQUEST = SchedulingRequest("m", "m")
ENDPOINTS = [Endpoint("pod-a", "10.0.0.1", 8000), Endpoint("pod-b", "10.0.0.2", 8000)]


class Clocks:
    """A monotonic and a wall clock that move together (seconds; unix ns)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def wall(self) -> int:
        return round(self.now * 1e9)


def snapshot(pod: str, seq: int, scraped_at: float, **fields: object) -> PodMetrics:
    address = {endpoint.name: endpoint.hostport for endpoint in ENDPOINTS}[pod]
    return PodMetrics(pool="p", pod=pod, address=address, seq=seq,
                      scrape_time_ns=round(scraped_at * 1e9), scrape_duration_s=0.0, ok=True,
                      **fields)  # type: ignore[arg-type]


@pytest.fixture
def clocks() -> Clocks:
    return Clocks()


@pytest.fixture
def table(clocks: Clocks) -> PodTable:
    table = PodTable(stale_after=1.0, clock=clocks, wall_clock=clocks.wall)
    table.set_endpoints(ENDPOINTS)
    return table


# --- reconciling snapshots by time -------------------------------------------------------------

def test_a_snapshot_clears_only_requests_routed_before_its_scrape_began() -> None:
    load = UnreportedLoad()
    load.routed("a", 100, at=1.0)
    load.routed("a", 200, at=2.0)
    load.routed("a", 400, at=3.0)
    load.reported("a", scrape_began=2.5)
    assert (load.counts["a"], load.tokens["a"]) == (1, 400)
    load.reported("a", scrape_began=3.5)
    assert "a" not in load.counts and "a" not in load.tokens


def test_a_peers_late_request_is_placed_at_its_routing_time() -> None:
    load = UnreportedLoad()
    load.routed("a", 10, at=2.0)
    load.routed("a", 20, at=1.0)  # applied after, routed before
    load.reported("a", scrape_began=1.5)
    assert (load.counts["a"], load.tokens["a"]) == (1, 10)


def test_unrouted_removes_the_request_of_those_tokens() -> None:
    load = UnreportedLoad()
    load.routed("a", 10, at=1.0)
    load.routed("a", 20, at=2.0)
    load.unrouted("a", 10)
    assert (load.counts["a"], load.tokens["a"]) == (1, 20)
    load.unrouted("a", 20)
    assert "a" not in load.counts and "a" not in load.tokens


def test_table_keeps_requests_routed_during_the_scrape_and_its_delivery(
        table: PodTable, clocks: Clocks) -> None:
    table.started("pod-a", 1000)  # at 100.0, before the scrape
    clocks.now = 100.02
    table.started("pod-a", 500)  # after the scrape began, before its delivery
    clocks.now = 100.025
    table.apply(snapshot("pod-a", 1, scraped_at=100.01))
    table.apply(snapshot("pod-b", 1, scraped_at=100.01))
    views = {view.name: view for view in table.fresh_views()}
    assert table.unreported() == {"pod-a": 1}
    assert views["pod-a"].unreported_tokens == 500
    assert views["pod-a"].in_flight == 2
    assert views["pod-a"].age == pytest.approx(0.015)


def test_a_skewed_clock_falls_back_to_clearing_at_arrival(table: PodTable,
                                                          clocks: Clocks) -> None:
    table.started("pod-a", 1000)
    table.apply(snapshot("pod-a", 1, scraped_at=clocks.now + 5))  # the collector runs ahead
    assert table.unreported() == {}
    table.started("pod-a", 1000)
    table.apply(snapshot("pod-a", 2, scraped_at=clocks.now - 50))  # far behind: no age either
    assert table.unreported() == {}
    assert table.fresh_views()[0].age == 0.0


def test_peers_requests_count_from_when_they_were_sent(table: PodTable,
                                                       clocks: Clocks) -> None:
    router = Router("p", table, random.Random(1))
    peers = PeerDecisions("me", lambda pool: router if pool == "p" else None, clock=clocks)
    table.apply(snapshot("pod-a", 1, scraped_at=clocks.now))
    sent = clocks.wall()
    clocks.now += 0.002
    routed = RoutedEvent(1, "pod-a", "m", Criticality.STANDARD, 300)
    peers.apply(DecisionBatch("peer", "p", sent, [routed]))
    assert table.peer_lag == pytest.approx(0.002)
    # One routed event: a rate of 1 per RATE_TAU second, times the lag.
    assert table.peer_unseen == pytest.approx(0.002)
    assert table.fresh_views()[0].recent_tokens == pytest.approx(300 * math.exp(-0.002 / 0.05))
    # Scraped 1 ms after the peer routed it, delivered after we heard of it: it shows it.
    clocks.now += 0.004
    table.apply(snapshot("pod-a", 2, scraped_at=clocks.now - 0.005))
    assert table.unreported() == {}
    assert table.fresh_views()[0].peer_lag == pytest.approx(0.002)
    clocks.now += 10  # the peer fell silent: gone, and with it the lag
    peers.expire()
    assert (table.peer_lag, table.peer_unseen) == (0.0, 0.0)


# --- the least-work picker -----------------------------------------------------------------------

def pod(name: str, in_flight: int = 0, tokens: float = 0.0, unseen: float = 0.0) -> PodView:
    return PodView(name, name, in_flight=in_flight, recent_tokens=tokens, peer_unseen=unseen)


def test_work_counts_recent_tokens_and_requests_in_flight() -> None:
    assert estimated_work(pod("a", in_flight=50, tokens=2048), 1024, 0.02) == 3.0


def test_a_lone_picker_takes_the_least_work() -> None:
    picker = LeastWork(random.Random(1))
    pods = [pod("a", tokens=3000), pod("b", in_flight=60, tokens=1000), pod("c", tokens=1500)]
    assert {picker.pick(REQUEST, pods).name for _ in range(50)} == {"c"}


def test_equal_work_is_a_random_choice() -> None:
    picker = LeastWork(random.Random(1))
    pods = [pod("a", tokens=2), pod("b", tokens=2), pod("c", tokens=9)]
    assert Counter(picker.pick(REQUEST, pods).name for _ in range(200)).keys() == {"a", "b"}


def test_with_unseen_peer_decisions_two_choices_spread_the_picks() -> None:
    # spread 1000: a peer's decision is surely unseen, every pick draws two.
    picker = LeastWork(random.Random(1), spread=1000.0)
    pods = [pod(name, tokens=work, unseen=0.3) for name, work in zip("abcd", (1, 2, 3, 4),
                                                                      strict=True)]
    counts = Counter(picker.pick(REQUEST, pods).name for _ in range(4000))
    assert "d" not in counts
    # Power of two choices over 4: the least wins 3/6 pairs, the next 2/6, then 1/6.
    assert counts["a"] > counts["b"] > counts["c"] > 0
    assert counts["a"] / 4000 == pytest.approx(0.5, abs=0.05)


def test_draws_grow_with_the_peers_unseen_decisions() -> None:
    def least_share(unseen: float) -> float:
        picker = LeastWork(random.Random(2), spread=1.0)
        pods = [pod(name, tokens=work, unseen=unseen) for name, work in zip(
            "abcd", (1, 2, 3, 4), strict=True)]
        return Counter(picker.pick(REQUEST, pods).name for _ in range(4000))["a"] / 4000

    assert least_share(0.0) == 1.0
    # P(draw) = 1 - exp(-0.5) = 0.39; a draw takes "a" half the time.
    assert least_share(0.5) == pytest.approx(1 - 0.39 * 0.5, abs=0.03)
    assert least_share(5.0) == pytest.approx(0.5, abs=0.05)


# --- near-ties in the profile --------------------------------------------------------------------

def profile(**params: object):
    return build_policy(PolicyConfig("prefix-aware", params), random.Random(3))


def test_pods_within_the_tie_margin_go_to_the_picker() -> None:
    pods = [PodView("low-kv", "a", kv_cache_usage=0.30, in_flight=9),
            PodView("idle", "b", kv_cache_usage=0.35, in_flight=1),
            PodView("full", "c", kv_cache_usage=0.90, in_flight=0)]
    decision = profile(tie_margin=0.1, stale_margin=0.0).schedule(REQUEST, pods)
    assert [view.name for view in decision.candidates] == ["low-kv", "idle"]
    assert decision.pick is not None and decision.pick.name == "idle"
    strict = profile(tie_margin=0.0, stale_margin=0.0).schedule(REQUEST, pods)
    assert strict.pick is not None and strict.pick.name == "low-kv"


def test_the_margin_grows_with_snapshot_age_and_peer_lag() -> None:
    policy = profile(tie_margin=0.1, stale_margin=2.0, max_margin=1.0)
    fresh = [PodView("a", "a", age=0.0), PodView("b", "b", age=0.0)]
    assert policy.margin(fresh) == pytest.approx(0.1)  # type: ignore[attr-defined]
    old = [PodView("a", "a", age=0.1, peer_lag=0.01), PodView("b", "b", age=0.3, peer_lag=0.01)]
    assert policy.margin(old) == pytest.approx(0.1 + 2.0 * 0.21)  # type: ignore[attr-defined]


def test_lora_affinity_outweighs_any_margin_of_fresh_state() -> None:
    request = SchedulingRequest("sql", "sql")
    pods = [PodView("busy-with-sql", "a", running_adapters=frozenset({"sql"}), max_lora=4,
                    in_flight=30, age=0.03),
            PodView("idle", "b", max_lora=4, in_flight=0, age=0.03)]
    decision = profile().schedule(request, pods)
    assert decision.pick is not None and decision.pick.name == "busy-with-sql"


def test_picker_params_are_checked() -> None:
    with pytest.raises(PolicyConfigError, match="choices"):
        profile(picker_params={"choices": 0})
    with pytest.raises(PolicyConfigError, match="unknown parameter"):
        profile(picker="random", picker_params={"choices": 2})


def test_picker_views_carry_ages_and_the_peer_lag() -> None:
    views = picker_views([PodView("a", "x"), PodView("b", "y")], {}, {}, {}, [0.01, 0.2], 0.002)
    assert [(view.age, view.peer_lag) for view in views] == [(0.01, 0.002), (0.2, 0.002)]


def test_the_margin_is_bounded_so_a_stopped_pod_cannot_tie_every_pod() -> None:
    policy = profile(tie_margin=0.1, stale_margin=2.0, max_margin=0.5)
    # A pod whose metrics stopped 2.9 s ago (stale after 3 s) is still a candidate.
    pods = [PodView("idle", "a", kv_cache_usage=0.1, age=2.9),
            PodView("busy", "b", waiting=200, kv_cache_usage=0.95, age=0.05)]
    assert policy.margin(pods) == 0.5  # type: ignore[attr-defined]
    assert [view.name for view in policy.schedule(REQUEST, pods).candidates] == ["idle"]


def test_queue_differences_count_against_a_span_that_grows_with_age() -> None:
    def queue_scores(age: float) -> list[float]:
        policy = profile(scorers=[{"plugin": "queue_load",
                                   "params": {"stale_span": 100.0, "max_span": 25.0}}])
        pods = [PodView("a", "a", waiting=0, age=age), PodView("b", "b", waiting=2, age=age),
                PodView("c", "c", waiting=100, age=age)]
        decision = policy.schedule(REQUEST, pods, explain=True)
        return [score.scores["queue_load"] for score in decision.scores]

    # Fresh: any difference spans the whole 0..1; 100 ms old: a span of at least 11 requests.
    assert queue_scores(0.0)[:2] == [1.0, pytest.approx(0.98)]
    assert queue_scores(0.1)[:2] == [1.0, pytest.approx(0.98)]  # 100 apart: min-max as ever
    small = profile(scorers=[{"plugin": "queue_load", "params": {"stale_span": 100.0}}])
    pods = [PodView("a", "a", waiting=0, age=0.1), PodView("b", "b", waiting=2, age=0.1)]
    scores = small.schedule(REQUEST, pods, explain=True).scores
    assert [score.scores["queue_load"] for score in scores] == [1.0, pytest.approx(1 - 2 / 11)]
    # Bounded: a 3 s old snapshot does not flatten a 100-request difference below 1 - 25 / 25.
    pods = [PodView("a", "a", waiting=0, age=3.0), PodView("b", "b", waiting=25, age=3.0)]
    scores = small.schedule(REQUEST, pods, explain=True).scores
    assert [score.scores["queue_load"] for score in scores] == [1.0, 0.0]
