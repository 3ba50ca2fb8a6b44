"""Routing one request body to a pod or an error (pure logic, fake clock, real policies)."""

from __future__ import annotations

import random
from collections import Counter

import msgspec
import pytest

from services.picker.routing import ModelRoute, Rejected, Routed, Router, rewrite_model
from services.picker.state import PodTable
from shared.registry_view import RegistryView
from shared.schemas import (
    Criticality,
    Endpoint,
    EndpointSet,
    InferenceModel,
    InferencePool,
    PodMetrics,
    PolicyConfig,
    TargetModel,
)

POOL = "pool-a"


class Fleet:
    """A router over a registry view and a pod table the test controls."""

    def __init__(self, **pool_fields: object) -> None:
        self.now = 0.0
        self.pods = PodTable(stale_after=1.0, clock=lambda: self.now)
        self.all_stale = 0
        self.router = Router(POOL, self.pods, random.Random(7), on_all_stale=self._stale)
        self.view = RegistryView()
        self.view.pools[POOL] = InferencePool(name=POOL, target_port=8000, **pool_fields)  # type: ignore[arg-type]
        self.view.models[POOL] = {}
        self.seq = 0

    def _stale(self) -> None:
        self.all_stale += 1

    def model(self, name: str, criticality: Criticality = Criticality.STANDARD,
              targets: dict[str, int] | None = None) -> Fleet:
        self.view.models[POOL][name] = InferenceModel(
            model_name=name, pool=POOL, criticality=criticality,
            target_models=tuple(TargetModel(t, w) for t, w in (targets or {}).items()))
        self.router.update(self.view)
        return self

    def pod(self, name: str, port: int, **metrics: object) -> Fleet:
        endpoints = self.view.endpoints.get(POOL, EndpointSet(pool=POOL)).endpoints
        others = tuple(e for e in endpoints if e.name != name)
        self.view.endpoints[POOL] = EndpointSet(
            pool=POOL, endpoints=(*others, Endpoint(name, "127.0.0.1", port)))
        self.router.update(self.view)
        self.seq += 1
        self.pods.apply(PodMetrics(pool=POOL, pod=name, address="x:1", seq=self.seq,
                                   scrape_time_ns=self.seq, scrape_duration_s=0.0, ok=True,
                                   **metrics))  # type: ignore[arg-type]
        return self

    def route(self, document: object) -> Routed | Rejected:
        return self.router.route(msgspec.json.encode(document))


def error_of(result: Routed | Rejected) -> tuple[int, dict]:
    assert isinstance(result, Rejected), result
    return result.status, msgspec.json.decode(result.body)["error"]


def test_request_goes_to_the_only_pod_with_a_short_queue() -> None:
    fleet = Fleet().model("chat").pod("busy", 8001, waiting=200).pod("idle", 8002, waiting=0)
    for _ in range(20):
        result = fleet.route({"model": "chat", "prompt": "hi"})
        assert isinstance(result, Routed)
        assert (result.pod, result.endpoint, result.body) == ("idle", "127.0.0.1:8002", None)


@pytest.mark.parametrize("body, code", [
    (b"not json", "invalid_json"),
    (b"[1, 2]", "invalid_request"),
    (b'{"prompt": "x"}', "missing_model"),
    (b'{"model": 42}', "invalid_request"),
    (b"", "invalid_json"),
])
def test_bad_bodies_are_400_in_openai_shape(body: bytes, code: str) -> None:
    fleet = Fleet().model("chat").pod("a", 8001)
    status, error = error_of(fleet.router.route(body))
    assert (status, error["code"], error["type"]) == (400, code, "invalid_request_error")
    assert error["message"]


def test_unknown_model_passes_through_unchanged_by_default() -> None:
    fleet = Fleet().model("chat").pod("a", 8001)
    result = fleet.route({"model": "base-model", "prompt": "x"})
    assert isinstance(result, Routed)
    assert (result.target_model, result.body, result.registered) == ("base-model", None, False)


def test_unknown_model_is_404_when_the_pool_rejects_them() -> None:
    fleet = Fleet(reject_unknown_models=True).model("chat").pod("a", 8001)
    status, error = error_of(fleet.route({"model": "nope"}))
    assert (status, error["code"]) == (404, "model_not_found")
    assert '"nope"' in error["message"]
    assert isinstance(fleet.route({"model": "chat"}), Routed)


def test_weighted_targets_are_drawn_by_weight_and_the_body_rewritten() -> None:
    fleet = Fleet().model("chat", targets={"chat-v1": 1, "chat-v2": 3}).pod("a", 8001)
    drawn: Counter[str] = Counter()
    for _ in range(2000):
        result = fleet.route({"model": "chat", "messages": [{"role": "user", "content": "x"}],
                              "stream": True})
        assert isinstance(result, Routed) and result.body is not None
        body = msgspec.json.decode(result.body)
        assert body == {"model": result.target_model,
                        "messages": [{"role": "user", "content": "x"}], "stream": True}
        assert result.model == "chat"
        drawn[result.target_model] += 1
    assert 0.70 < drawn["chat-v2"] / 2000 < 0.80


def test_zero_weights_split_evenly_and_one_target_is_fixed() -> None:
    route = ModelRoute.of(InferenceModel(model_name="m", pool=POOL, target_models=(
        TargetModel("x", 0), TargetModel("y", 0))))
    rng = random.Random(1)
    assert {route.draw(rng) for _ in range(200)} == {"x", "y"}
    only = ModelRoute.of(InferenceModel(model_name="m", pool=POOL))
    assert only.draw(rng) == "m"


def test_sheddable_request_is_429_when_every_pod_is_saturated() -> None:
    fleet = (Fleet().model("batch", Criticality.SHEDDABLE).model("chat", Criticality.CRITICAL)
             .pod("a", 8001, waiting=30, kv_cache_usage=0.95)
             .pod("b", 8002, waiting=40, kv_cache_usage=0.9))
    status, error = error_of(fleet.route({"model": "batch"}))
    assert (status, error["code"], error["type"]) == (429, "pool_saturated", "rate_limit_error")
    assert isinstance(fleet.route({"model": "chat"}), Routed)


def test_no_endpoint_is_503() -> None:
    fleet = Fleet().model("chat")
    status, error = error_of(fleet.route({"model": "chat"}))
    assert (status, error["code"]) == (503, "no_ready_endpoint")
    assert isinstance(fleet.router.route_bodiless(), Rejected)


def test_all_stale_picks_uniformly_among_members_and_counts() -> None:
    fleet = Fleet().model("chat").pod("a", 8001, waiting=0).pod("b", 8002, waiting=500)
    fleet.now += 5.0
    picked = Counter()
    for _ in range(400):
        result = fleet.route({"model": "chat"})
        assert isinstance(result, Routed)
        picked[result.pod] += 1
    assert fleet.all_stale == 400
    assert 120 < picked["b"] < 280  # the stale queue length no longer counts


def test_stale_pod_is_not_offered_while_a_fresh_one_exists() -> None:
    fleet = Fleet().model("chat").pod("best", 8001, waiting=0)
    fleet.now += 0.8
    fleet.pod("worse", 8002, waiting=100)
    fleet.now += 0.5  # "best" is 1.3 s old now, "worse" 0.5 s
    assert {fleet.route({"model": "chat"}).pod for _ in range(20)} == {"worse"}  # type: ignore[union-attr]
    assert fleet.all_stale == 0


def test_bodiless_request_goes_to_a_fresh_pod() -> None:
    fleet = Fleet().pod("a", 8001)
    fleet.now += 0.9
    fleet.pod("b", 8002)
    fleet.now += 0.2
    assert {fleet.router.route_bodiless().pod for _ in range(20)} == {"b"}  # type: ignore[union-attr]


def test_policy_follows_the_pool_configuration() -> None:
    fleet = Fleet().pod("a", 8001).pod("b", 8002)
    assert fleet.router.policy.name == "filter-tree"
    fleet.view.pools[POOL] = InferencePool(name=POOL, target_port=8000,
                                           policy=PolicyConfig(name="round-robin"))
    fleet.router.update(fleet.view)
    assert fleet.router.policy.name == "round-robin"
    assert {fleet.route({"model": "m"}).pod for _ in range(4)} == {"a", "b"}  # type: ignore[union-attr]
    fleet.view.pools[POOL] = InferencePool(name=POOL, target_port=8000,
                                           policy=PolicyConfig(name="no-such-policy"))
    fleet.router.update(fleet.view)
    assert fleet.router.policy.name == "round-robin"  # a bad config keeps the last good policy


def test_rewrite_model_keeps_everything_else() -> None:
    body = b'{"model":"a","n":1.5,"big":12345678901234567890,"s":"\\u00e9","nested":{"model":"k"}}'
    assert msgspec.json.decode(rewrite_model(body, "b")) == {
        "model": "b", "n": 1.5, "big": 12345678901234567890, "s": "\u00e9",
        "nested": {"model": "k"}}
