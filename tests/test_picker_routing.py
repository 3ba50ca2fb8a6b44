"""Routing one request body to a pod or an error (pure logic, fake clock, real policies)."""

from __future__ import annotations

import json
import random
from collections import Counter

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.picker.routing import ModelRoute, Rejected, Routed, Router, rewrite_model
from services.picker.state import PodTable
from shared.registry_view import RegistryChanges, RegistryView
from shared.schemas import (
    DEFAULT_POLICY_NAME,
    Criticality,
    Endpoint,
    EndpointSet,
    InferenceModel,
    InferencePool,
    PodMetrics,
    PolicyConfig,
    TargetModel,
    encode,
)
from shared.subjects import model_key, pool_key

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
    assert fleet.router.policy.name == DEFAULT_POLICY_NAME == "prefix-aware"
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


# --- client mistakes and hostile bodies (issue 13, item 7) -------------------------------------

def _deep(levels: int, before_model: bool = False) -> bytes:
    nested = b"[" * levels + b"]" * levels
    if before_model:
        return b'{"x":' + nested + b',"model":"chat"}'
    return b'{"model":"chat","x":' + nested + b"}"


HOSTILE_BODIES = {
    "deep arrays": (_deep(5000), 400, "json_too_deep"),
    "deep arrays before model": (_deep(5000, before_model=True), 400, "json_too_deep"),
    "deep objects": (b'{"model":"chat","x":' + b'{"a":' * 3000 + b"1" + b"}" * 3000 + b"}", 400,
                     "json_too_deep"),
    "top-level key not UTF-8": (b'{"model":"chat","\xff":1}', 400, "invalid_json"),
    "array at top level": (b'[{"model":"chat"}]', 400, "invalid_request"),
    "string at top level": (b'"chat"', 400, "invalid_request"),
    "model is a number": (b'{"model":1}', 400, "invalid_request"),
    "model is an object": (b'{"model":{"name":"chat"}}', 400, "invalid_request"),
    "model is null": (b'{"model":null}', 400, "missing_model"),
    "NaN": (b'{"model":"chat","x":NaN}', 400, "invalid_json"),
    "trailing garbage": (b'{"model":"chat"} {}', 400, "invalid_json"),
    "empty": (b"", 400, "invalid_json"),
}


@pytest.mark.parametrize("body, status, code", HOSTILE_BODIES.values(), ids=HOSTILE_BODIES.keys())
def test_client_mistakes_are_400_with_a_code_never_500(body: bytes, status: int,
                                                       code: str) -> None:
    fleet = Fleet().model("chat", targets={"chat-v2": 1}).pod("a", 8001)
    status_, error = error_of(fleet.router.route(body))
    assert (status_, error["code"], error["type"]) == (status, code, "invalid_request_error")


@pytest.mark.parametrize("extra", [b"1e400", b"-1e400", b"9" * 5000, b'"\xff\xfe"',
                                   b'{"k":"\xc3("}', b"[" + b"1," * 100_000 + b"1]"],
                         ids=["1e400", "-1e400", "5000-digit integer", "string not UTF-8",
                              "nested string not UTF-8", "100k-element array"])
def test_a_rewritten_body_keeps_every_other_member_byte_for_byte(extra: bytes) -> None:
    fleet = Fleet().model("chat", targets={"chat-v2": 1}).pod("a", 8001)
    body = b'{"model":"chat","x":' + extra + b',"tail":true}'
    result = fleet.router.route(body)
    assert isinstance(result, Routed), result
    assert result.body == b'{"model":"chat-v2","x":' + extra + b',"tail":true}'
    unchanged = Fleet().model("chat").pod("a", 8001).router.route(body)
    assert isinstance(unchanged, Routed) and unchanged.body is None  # passed through as sent


def test_duplicate_model_keys_route_and_rewrite_the_last_one_as_python_reads_it() -> None:
    fleet = Fleet().model("chat", targets={"chat-v2": 1}).model("other").pod("a", 8001)
    result = fleet.router.route(b'{"model":"other","n":1,"model":"chat"}')
    assert isinstance(result, Routed)
    assert (result.model, result.target_model) == ("chat", "chat-v2")
    assert json.loads(result.body or b"") == {"model": "chat-v2", "n": 1}


def test_a_byte_order_mark_is_ignored_as_python_json_does() -> None:
    fleet = Fleet().model("chat", targets={"chat-v2": 1}).pod("a", 8001)
    result = fleet.router.route(b'\xef\xbb\xbf{"model":"chat","n":[1]}')
    assert isinstance(result, Routed)
    assert result.body == b'{"model":"chat-v2","n":[1]}'


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(members=st.dictionaries(st.text(max_size=8), _json_values, max_size=5),
       model=st.sampled_from(["chat", "plain", "unknown", ""]),
       cut=st.integers(min_value=0, max_value=400), junk=st.binary(max_size=8))
def test_any_body_is_routed_or_a_400_and_a_rewrite_changes_only_model(
        members: dict, model: str, cut: int, junk: bytes) -> None:
    fleet = _ROUTING_FLEET
    document = {**members, "model": model}
    body = json.dumps(document).encode()
    result = fleet.router.route(body)
    assert isinstance(result, Routed), result
    if model == "chat":
        assert json.loads(result.body or b"") == {**document, "model": "chat-v2"}
    else:
        assert result.body is None
    # The same body truncated or with bytes spliced in: routed or a 400, never anything else.
    broken = body[:cut] + junk + body[cut:]
    outcome = fleet.router.route(broken)
    assert isinstance(outcome, Routed) or outcome.status == 400, outcome


def test_a_prompt_of_the_wrong_type_before_malformed_json_is_a_400() -> None:
    """Found by the property above: the typed read stops at ``"prompt": false``, the
    model-only read then meets the malformed JSON after it, and raised out of the router."""
    body = b'{"prompt": false\x00, "model": "chat"}'
    status, error = error_of(_ROUTING_FLEET.router.route(body))
    assert (status, error["code"]) == (400, "invalid_json")


_ROUTING_FLEET = Fleet().model("chat", targets={"chat-v2": 1}).model("plain").pod("a", 8001)


def test_an_incremental_update_routes_as_a_full_rebuild_does() -> None:
    rng = random.Random(5)
    view = RegistryView()
    view.pools[POOL] = InferencePool(name=POOL, target_port=8000)
    incremental = Router(POOL, PodTable(stale_after=1.0), random.Random(1))
    incremental.update(view)
    names = [f"m{index}" for index in range(30)]
    for _ in range(200):
        changes = RegistryChanges()
        for name in rng.sample(names, 3):
            key = model_key(POOL, name)
            target = TargetModel(f"{name}-{rng.random()}", 1)
            value = None if rng.random() < 0.3 else encode(InferenceModel(
                model_name=name, pool=POOL, target_models=(target,)))
            view.apply(key, value, changes)
        view.apply(model_key("other-pool", "m1"), encode(InferenceModel("m1", "other-pool")),
                   changes)
        if rng.random() < 0.1:
            view.apply(pool_key(POOL), encode(InferencePool(
                name=POOL, target_port=8000, reject_unknown_models=rng.random() < 0.5)), changes)
        incremental.update(view, changes)
        rebuilt = Router(POOL, PodTable(stale_after=1.0), random.Random(1))
        rebuilt.update(view)
        for name in names:
            body = msgspec.json.encode({"model": name})
            assert _target(incremental.route(body)) == _target(rebuilt.route(body)), name


def _target(result: Routed | Rejected) -> tuple[int, str]:
    return (0, result.target_model) if isinstance(result, Routed) else (result.status,
                                                                         result.target_model)
