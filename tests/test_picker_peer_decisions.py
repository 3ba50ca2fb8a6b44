"""The decision stream's logic (no network): the gateway's events, peers' events in the load
estimate, their expiry (fake clock), the batch schema, the flag."""

from __future__ import annotations

import argparse
import random
import time

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from services.picker.app import build_gateway, decision_publisher
from services.picker.decision_stream import DecisionSink
from services.picker.main import configure, settings_from
from services.picker.observability import PickerMetrics
from services.picker.peer_decisions import MIN_SILENCE, SILENCE_HEARTBEATS
from services.picker.pools import Gateway
from services.picker.routing import Routed, Router
from services.picker.state import PodTable
from shared.registry_view import RegistryView
from shared.schemas import (
    Criticality,
    DecisionBatch,
    DecisionEvent,
    Endpoint,
    EndpointSet,
    FinishedEvent,
    InferenceModel,
    InferencePool,
    PodMetrics,
    RoutedEvent,
    ShedEvent,
    decode,
    encode,
)
from shared.subjects import Subjects

POOL = "pool-1"
ENDPOINTS = [Endpoint("pod-a", "10.0.0.1", 8000), Endpoint("pod-b", "10.0.0.2", 8000),
             Endpoint("pod-c", "10.0.0.3", 8000)]
BODY = b'{"model": "m", "prompt": "hi"}'
LONG_BODY = b'{"model": "m", "max_tokens": 64, "prompt": "%s"}' % (b"a long prompt " * 300)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def snapshot(pod: str, seq: int, **fields: object) -> PodMetrics:
    address = next(e.hostport for e in ENDPOINTS if e.name == pod)
    return PodMetrics(pool=POOL, pod=pod, address=address, seq=seq,
                      scrape_time_ns=seq * 1_000_000, scrape_duration_s=0.01, ok=True,
                      **fields)  # type: ignore[arg-type]


def gateway(clock: FakeClock, picker_id: str = "me",
            events: list[tuple[str, DecisionEvent]] | None = None,
            model: InferenceModel | None = None) -> Gateway:
    """A one-pool gateway on the fake clock whose pods all reported an idle snapshot."""
    pods = PodTable(stale_after=1000.0, clock=clock)
    router = Router(POOL, pods, random.Random(1))
    on_decision = None if events is None else (lambda pool, e: events.append((pool, e)))
    gw = Gateway([POOL], lambda pool: router, on_decision=on_decision, picker_id=picker_id,
                 clock=clock)
    view = RegistryView()
    view.pools[POOL] = InferencePool(POOL, 8000)
    view.models[POOL] = {"m": model or InferenceModel("m", POOL)}
    view.endpoints[POOL] = EndpointSet(POOL, tuple(ENDPOINTS))
    gw.update(view)
    for endpoint in ENDPOINTS:
        pods.apply(snapshot(endpoint.name, 1))
    return gw


def views(gw: Gateway) -> dict[str, tuple[int, int]]:
    """(waiting, in_flight) per pod as the policy sees them."""
    table = gw.table(POOL)
    assert table is not None
    return {view.name: (view.waiting, view.in_flight) for view in table.fresh_views()}


def routed(request_id: int, pod: str) -> RoutedEvent:
    return RoutedEvent(request_id, pod, "m", Criticality.STANDARD)


def batch(picker: str, *events: DecisionEvent, heartbeat_s: float = 0.5) -> DecisionBatch:
    return DecisionBatch(picker, POOL, time.time_ns(), list(events), heartbeat_s)


# --- the core: own events out, peers' events in -------------------------------------------

def test_routed_and_finished_requests_are_reported_with_their_pool_and_id() -> None:
    events: list[tuple[str, DecisionEvent]] = []
    gw = gateway(FakeClock(), events=events)
    first, second = gw.route(LONG_BODY), gw.route(BODY)
    assert isinstance(first, Routed) and isinstance(second, Routed)
    gw.started(first)
    gw.started(second)
    gw.finished(first, 12, 34)
    assert first.prompt_tokens > 500 and first.max_tokens == 64 and first.prefix_hashes
    assert events == [  # nothing cached yet: prefill_tokens None, the whole prompt
        (POOL, RoutedEvent(first.request_id, first.pod, "m", Criticality.STANDARD,
                           first.prompt_tokens, 64, first.prefix_hashes)),
        (POOL, RoutedEvent(second.request_id, second.pod, "m", Criticality.STANDARD,
                           second.prompt_tokens)),
        (POOL, FinishedEvent(first.request_id, first.pod, 12, 34)),
    ]
    assert first.request_id != second.request_id


def test_a_peers_prompt_counts_in_tokens_and_in_the_prefix_index() -> None:
    events: list[tuple[str, DecisionEvent]] = []
    sender, receiver = gateway(FakeClock(), events=events), gateway(FakeClock())
    routed_here = sender.route(LONG_BODY)
    assert isinstance(routed_here, Routed)
    sender.started(routed_here)
    receiver.apply_peer(batch("sender", *(event for _, event in events)))
    router = receiver.router(POOL)
    assert router is not None
    assert router.prefixes.match(routed_here.prefix_hashes) == {
        routed_here.pod: len(routed_here.prefix_hashes)}
    tokens = {view.name: view.unreported_tokens for view in router.pods.fresh_views()}
    own = sender.table(POOL)
    assert own is not None
    assert tokens == {view.name: view.unreported_tokens for view in own.fresh_views()}
    assert tokens[routed_here.pod] == routed_here.prompt_tokens


def test_a_shed_request_is_reported() -> None:
    events: list[tuple[str, DecisionEvent]] = []
    gw = gateway(FakeClock(), events=events,
                 model=InferenceModel("m", POOL, criticality=Criticality.SHEDDABLE))
    table = gw.table(POOL)
    assert table is not None
    for endpoint in ENDPOINTS:  # every pod saturated: a sheddable request is dropped
        table.apply(snapshot(endpoint.name, 2, waiting=100, kv_cache_usage=0.99))
    rejected = gw.route(BODY)
    assert not isinstance(rejected, Routed) and rejected.status == 429
    assert [(pool, type(e)) for pool, e in events] == [(POOL, ShedEvent)]
    assert events[0][1] == ShedEvent(events[0][1].request_id, "m", Criticality.SHEDDABLE)


def test_a_request_served_by_a_fallback_is_reported_routed_again_there() -> None:
    events: list[tuple[str, DecisionEvent]] = []
    gw = gateway(FakeClock(), events=events)
    first = gw.route(BODY)
    assert isinstance(first, Routed)
    gw.started(first)
    other = next(e.name for e in ENDPOINTS if e.name != first.pod)
    gw.served_elsewhere(first, other)
    assert events[-1] == (POOL, RoutedEvent(first.request_id, other, "m", Criticality.STANDARD,
                                            first.prompt_tokens))
    peer = gateway(FakeClock())
    peer.apply_peer(batch("a", *(event for _, event in events)))
    assert views(peer)[other][1] == 1 and views(peer)[first.pod][1] == 0


def test_peer_requests_count_exactly_as_own_ones() -> None:
    clock = FakeClock()
    own, peer = gateway(clock), gateway(clock)
    for request_id, pod in enumerate(["pod-a", "pod-a", "pod-b"]):
        own.started(Routed(pod, "", "m", "m", True, pool=POOL, request_id=request_id))
    peer.apply_peer(batch("other", *(routed(i, pod) for i, pod in
                                     enumerate(["pod-a", "pod-a", "pod-b"]))))
    assert views(peer) == views(own) == {"pod-a": (2, 2), "pod-b": (1, 1), "pod-c": (0, 0)}


def test_own_batches_are_not_applied_twice() -> None:
    gw = gateway(FakeClock(), picker_id="me")
    gw.apply_peer(batch("me", routed(1, "pod-a")))
    assert views(gw)["pod-a"] == (0, 0)
    assert gw.peers.own == 1 and gw.peers.applied == 0


def test_finished_ends_in_flight_and_the_next_snapshot_clears_unreported() -> None:
    gw = gateway(FakeClock())
    gw.apply_peer(batch("other", routed(1, "pod-a"), routed(2, "pod-a")))
    gw.apply_peer(batch("other", FinishedEvent(1, "pod-a")))
    assert views(gw)["pod-a"] == (2, 1)  # both still unreported, one in flight
    table = gw.table(POOL)
    assert table is not None
    table.apply(snapshot("pod-a", 2, waiting=0))
    assert views(gw)["pod-a"] == (0, 1)
    gw.apply_peer(batch("other", FinishedEvent(2, "pod-a"), FinishedEvent(99, "pod-a")))
    assert views(gw)["pod-a"] == (0, 0)  # an unknown id (routed before we listened) is ignored


def test_a_silent_peer_contributes_nothing_after_four_heartbeats() -> None:
    clock = FakeClock()
    gw = gateway(clock)
    gw.apply_peer(batch("other", routed(1, "pod-a"), heartbeat_s=0.5))
    gw.apply_peer(batch("alive", routed(1, "pod-b"), heartbeat_s=0.5))
    allowance = max(MIN_SILENCE, SILENCE_HEARTBEATS * 0.5)
    for _ in range(10):  # "alive" keeps sending heartbeats (empty batches); "other" is silent
        clock.now += allowance / 4
        gw.apply_peer(batch("alive", heartbeat_s=0.5))
        assert gw.expire_peers() == 0 or clock.now > 100.0 + allowance
    assert views(gw)["pod-a"][1] == 0
    assert views(gw)["pod-b"][1] == 1
    assert gw.peers.expired == 1 and gw.peers.peers() == 1


def test_a_silent_peer_is_kept_within_its_allowance() -> None:
    clock = FakeClock()
    gw = gateway(clock)
    gw.apply_peer(batch("other", routed(1, "pod-a"), heartbeat_s=1.0))
    clock.now += SILENCE_HEARTBEATS * 1.0 - 0.01
    assert gw.expire_peers() == 0 and views(gw)["pod-a"][1] == 1
    clock.now += 0.02
    assert gw.expire_peers() == 1 and views(gw)["pod-a"][1] == 0


def test_a_request_without_finished_event_expires_after_its_ttl() -> None:
    clock = FakeClock()
    gw = gateway(clock)
    gw.peers.request_ttl = 10.0
    gw.apply_peer(batch("other", routed(1, "pod-a")))
    clock.now += 6
    gw.apply_peer(batch("other", routed(2, "pod-b")))
    for _ in range(3):  # heartbeats keep the peer alive past the first request's TTL
        clock.now += 1.5
        gw.apply_peer(batch("other"))
    assert gw.expire_peers() == 1
    assert views(gw)["pod-a"][1] == 0 and views(gw)["pod-b"][1] == 1


def test_batches_of_pools_not_served_are_counted_not_applied() -> None:
    gw = gateway(FakeClock())
    gw.apply_peer(DecisionBatch("other", "elsewhere", 0, [routed(1, "pod-a")]))
    assert gw.peers.not_served == 1 and views(gw)["pod-a"] == (0, 0)


def test_requests_to_pods_that_are_no_members_are_not_counted() -> None:
    gw = gateway(FakeClock())
    gw.apply_peer(batch("other", routed(1, "pod-gone"), routed(2, "pod-a")))
    table = gw.table(POOL)
    assert table is not None
    assert table.peer_in_flight() == {"pod-a": 1} and table.unreported() == {"pod-a": 1}
    assert gw.peers.unknown_pod == 1 and gw.peers.in_flight() == 1


def test_undecodable_batches_are_counted_and_skipped() -> None:
    applied: list[DecisionBatch] = []
    bad: list[int] = []
    sink = DecisionSink(applied.append, on_undecodable=lambda: bad.append(1))
    good = batch("other", routed(1, "pod-a"))
    wrong_schema = msgspec.structs.replace(good, schema=99)
    for payload in (b"", b"\xc1garbage", encode(wrong_schema), b"\x93\x01\x02\x03",
                    encode(msgspec.structs.replace(good, events=[])) + b"x"):
        sink.accept("lig.decisions.pool-1", payload)
    sink.accept("lig.decisions.pool-1", encode(good))
    assert len(bad) == 5 and applied == [good]


def test_the_batch_encoding_is_compact_and_round_trips() -> None:
    events: list[DecisionEvent] = [
        RoutedEvent(7, "pod-a", "m", Criticality.CRITICAL, 4000, 128, (1, 2**64 - 1)),
        FinishedEvent(7, "pod-a", 4000, None), ShedEvent(8, "m", Criticality.SHEDDABLE)]
    original = DecisionBatch("picker-1", POOL, 123, events)
    data = encode(original)
    assert decode(data, DecisionBatch) == original
    one = encode(DecisionBatch("picker-1", POOL, 123, [routed(123456, "pod-a")]))
    empty = encode(DecisionBatch("picker-1", POOL, 123, []))
    # A routed event without hashes: 29 bytes (28 before prefill_tokens, nil here).
    assert len(one) - len(empty) <= 29


# --- the flag ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "env", "shared"), [
    ([], None, True), (["--no-shared-decisions"], None, False), ([], "0", False),
    ([], "off", False), (["--shared-decisions"], "0", True), ([], "1", True)])
def test_shared_decisions_is_on_by_default_and_turned_off_by_flag_or_env(
        monkeypatch: pytest.MonkeyPatch, argv: list[str], env: str | None,
        shared: bool) -> None:
    if env is None:
        monkeypatch.delenv("LIG_SHARED_DECISIONS", raising=False)
    else:
        monkeypatch.setenv("LIG_SHARED_DECISIONS", env)
    parser = argparse.ArgumentParser()
    configure(parser)
    settings = settings_from(parser.parse_args([*argv, "--pool", POOL]))
    metrics = PickerMetrics(CollectorRegistry())
    publisher = decision_publisher(settings, Subjects(), metrics)
    assert publisher is not None  # it publishes the decision records, too
    assert (publisher.decisions is not None) is shared
    gw = build_gateway(settings, metrics, publisher)
    assert gw.on_decision is publisher.decisions
    if publisher.decisions is not None:
        assert gw.peers.picker_id == publisher.picker_id != ""
