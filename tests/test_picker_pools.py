"""One picker over several pools (pure logic): model -> pool resolution, per-pool policies and
pod tables, name conflicts, unknown models, and the model list answered from the registry."""

from __future__ import annotations

import random
from collections import Counter

import msgspec
import pytest

from services.picker.pools import Gateway, UnknownModels
from services.picker.routing import Answered, Rejected, Routed, Router
from services.picker.state import PodTable
from shared.registry_view import RegistryChanges, RegistryView
from shared.schemas import (
    Criticality,
    Endpoint,
    EndpointSet,
    InferenceModel,
    InferencePool,
    PodMetrics,
    TargetModel,
    encode,
)
from shared.subjects import model_key


class Fleet:
    """A registry view and a gateway over pools ``llama`` and ``qwen``, one fresh pod each."""

    def __init__(self, pools: tuple[str, ...] = ("llama", "qwen"), served: tuple[str, ...] = (),
                 unknown: UnknownModels | None = None) -> None:
        self.view = RegistryView()
        self.conflict_counts: list[int] = []
        self.gateway = Gateway(served, self._router, unknown,
                               on_conflicts=self.conflict_counts.append)
        for index, pool in enumerate(pools):
            self.view.pools[pool] = InferencePool(name=pool, target_port=8000)
            self.view.models[pool] = {}
            self.view.endpoints[pool] = EndpointSet(pool=pool, endpoints=(
                Endpoint(f"{pool}-0", f"10.0.{index}.1", 8000),))
        self.gateway.update(self.view)
        for pool in pools:
            self.report(pool)

    def _router(self, pool: str) -> Router:
        return Router(pool, PodTable(stale_after=60.0), random.Random(1))

    def report(self, pool: str, **fields: object) -> None:
        table = self.gateway.table(pool)
        if table is None:
            return
        endpoint = self.view.endpoints[pool].endpoints[0]
        table.apply(PodMetrics(pool=pool, pod=endpoint.name, address=endpoint.hostport,
                               seq=len(fields) + 2, scrape_time_ns=len(fields) + 2,
                               scrape_duration_s=0.0, ok=True, **fields))  # type: ignore[arg-type]

    def model(self, pool: str, name: str, **fields: object) -> None:
        """Register (or change) a model and hand the gateway only that change."""
        self.view.models.setdefault(pool, {})[name] = InferenceModel(
            model_name=name, pool=pool, **fields)  # type: ignore[arg-type]
        self.gateway.update(self.view, RegistryChanges(models={pool: {name}}))

    def remove(self, pool: str, name: str) -> None:
        self.view.models[pool].pop(name)
        self.gateway.update(self.view, RegistryChanges(models={pool: {name}}))

    def route(self, model: str) -> Routed | Rejected:
        return self.gateway.route(msgspec.json.encode({"model": model, "prompt": "hi"}))


def pool_of(result: Routed | Rejected) -> str:
    assert isinstance(result, Routed), result
    return result.pool


def test_each_model_is_routed_to_its_own_pool_only() -> None:
    fleet = Fleet()
    fleet.model("llama", "llama-8b")
    fleet.model("llama", "llama-sql", target_models=(TargetModel("sql-lora", 1),))
    fleet.model("qwen", "qwen-32b")
    assert {fleet.route("llama-8b").pod for _ in range(20)} == {"llama-0"}  # type: ignore[union-attr]
    assert {fleet.route("qwen-32b").pod for _ in range(20)} == {"qwen-0"}  # type: ignore[union-attr]
    routed = fleet.route("llama-sql")
    assert isinstance(routed, Routed)
    assert (routed.pool, routed.endpoint, routed.target_model) == ("llama", "10.0.0.1:8000",
                                                                   "sql-lora")


def test_weighted_splits_and_criticality_are_each_pools_own() -> None:
    fleet = Fleet()
    fleet.model("llama", "chat", target_models=(TargetModel("a", 3), TargetModel("b", 1)))
    fleet.model("qwen", "batch", criticality=Criticality.SHEDDABLE)
    draws = Counter(fleet.route("chat").target_model for _ in range(2000))  # type: ignore[union-attr]
    assert set(draws) == {"a", "b"}
    assert 0.70 < draws["a"] / 2000 < 0.80
    fleet.report("qwen", waiting=50, kv_cache_usage=0.95)  # qwen saturated: sheddable dropped
    shed = fleet.route("batch")
    assert isinstance(shed, Rejected) and (shed.status, shed.pool) == (429, "qwen")
    fleet.report("llama", waiting=50, kv_cache_usage=0.95)
    assert pool_of(fleet.route("chat")) == "llama"  # standard: still routed


def test_a_model_moved_to_another_pool_follows_it() -> None:
    fleet = Fleet()
    fleet.model("llama", "m")
    assert pool_of(fleet.route("m")) == "llama"
    fleet.view.models["llama"].pop("m")
    fleet.view.models["qwen"]["m"] = InferenceModel(model_name="m", pool="qwen")
    fleet.gateway.update(fleet.view, RegistryChanges(models={"llama": {"m"}, "qwen": {"m"}}))
    assert pool_of(fleet.route("m")) == "qwen"
    assert fleet.gateway.conflicts == {}


def test_a_name_in_two_pools_is_reported_and_keeps_its_pool(
        caplog: pytest.LogCaptureFixture) -> None:
    fleet = Fleet()
    fleet.model("llama", "shared")
    fleet.model("qwen", "shared")  # published second: a conflict
    assert pool_of(fleet.route("shared")) == "llama"  # the last good state
    assert fleet.conflict_counts[-1] == 1
    assert "'shared' is registered in pools llama, qwen" in caplog.text
    assert fleet.gateway.conflicts["shared"].kept == "llama"
    fleet.remove("llama", "shared")  # resolved: it now lives in qwen only
    assert pool_of(fleet.route("shared")) == "qwen"
    assert fleet.conflict_counts[-1] == 0
    assert fleet.gateway.conflicts == {}


def test_a_new_name_born_in_conflict_is_not_routed_until_resolved() -> None:
    fleet = Fleet()
    fleet.view.models["llama"]["both"] = InferenceModel(model_name="both", pool="llama")
    fleet.view.models["qwen"]["both"] = InferenceModel(model_name="both", pool="qwen")
    fleet.gateway.update(fleet.view)  # a full resync
    answer = fleet.route("both")
    assert isinstance(answer, Rejected) and answer.status == 404
    assert "registered in several pools: llama, qwen" in msgspec.json.decode(answer.body)[
        "error"]["message"]


def test_unknown_models_with_several_pools_are_404_unless_a_default_pool_takes_them() -> None:
    fleet = Fleet()
    answer = fleet.route("nobody")
    assert isinstance(answer, Rejected) and answer.status == 404
    assert msgspec.json.decode(answer.body)["error"]["code"] == "model_not_found"
    fleet = Fleet(unknown=UnknownModels(default_pool="qwen"))
    routed = fleet.route("nobody")
    assert isinstance(routed, Routed) and (routed.pool, routed.registered) == ("qwen", False)
    fleet = Fleet(unknown=UnknownModels(reject=True, default_pool="qwen"))
    assert fleet.route("nobody").status == 404  # type: ignore[union-attr]


def test_the_default_pools_own_reject_field_still_applies() -> None:
    fleet = Fleet(pools=("solo",))  # one pool: it is the default, as before several pools
    assert pool_of(fleet.route("anything")) == "solo"
    fleet.view.pools["solo"] = InferencePool(name="solo", target_port=8000,
                                             reject_unknown_models=True)
    fleet.gateway.update(fleet.view, RegistryChanges(pools={"solo"}))
    answer = fleet.route("anything")
    assert isinstance(answer, Rejected) and answer.status == 404


def test_a_default_pool_not_served_is_refused() -> None:
    with pytest.raises(ValueError, match="not one of the pools served"):
        Fleet(served=("llama",), unknown=UnknownModels(default_pool="qwen"))


def test_explicit_pools_ignore_the_others() -> None:
    fleet = Fleet(served=("llama",))
    fleet.model("qwen", "qwen-only")
    assert set(fleet.gateway.routers) == {"llama"}
    assert fleet.gateway.table("qwen") is None
    assert pool_of(fleet.route("qwen-only")) == "llama"  # unknown here: the only pool takes it


def test_serving_every_pool_picks_up_pools_as_they_are_published() -> None:
    fleet = Fleet()
    fleet.view.pools["new"] = InferencePool(name="new", target_port=8000)
    fleet.view.endpoints["new"] = EndpointSet(pool="new", endpoints=(
        Endpoint("new-0", "10.0.9.1", 8000),))
    fleet.view.models["new"] = {"fresh": InferenceModel(model_name="fresh", pool="new")}
    fleet.gateway.update(fleet.view, RegistryChanges(pools={"new"}, endpoints={"new"},
                                                     models={"new": {"fresh"}}))
    fleet.report("new")
    assert pool_of(fleet.route("fresh")) == "new"


def test_one_pool_without_pods_fails_only_its_own_models() -> None:
    fleet = Fleet()
    fleet.model("llama", "llama-8b")
    fleet.model("qwen", "qwen-32b")
    fleet.view.endpoints["qwen"] = EndpointSet(pool="qwen")
    fleet.gateway.update(fleet.view, RegistryChanges(endpoints={"qwen"}))
    answer = fleet.route("qwen-32b")
    assert isinstance(answer, Rejected) and (answer.status, answer.pool) == (503, "qwen")
    assert pool_of(fleet.route("llama-8b")) == "llama"


def test_model_list_names_every_pools_models() -> None:
    fleet = Fleet()
    fleet.model("llama", "llama-8b")
    fleet.model("qwen", "qwen-32b")
    answer = fleet.gateway.route_bodiless("GET", "/v1/models?x=1")
    assert isinstance(answer, Answered) and answer.status == 200
    listing = msgspec.json.decode(answer.body)
    assert listing["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in listing["data"]] == [
        ("llama-8b", "model", "llama"), ("qwen-32b", "model", "qwen")]
    fleet.remove("qwen", "qwen-32b")
    listing = msgspec.json.decode(fleet.gateway.route_bodiless("GET", "/v1/models").body)  # type: ignore[union-attr]
    assert [m["id"] for m in listing["data"]] == ["llama-8b"]
    one = fleet.gateway.route_bodiless("GET", "/v1/models/llama-8b")
    assert msgspec.json.decode(one.body)["id"] == "llama-8b"  # type: ignore[union-attr]
    assert fleet.gateway.route_bodiless("GET", "/v1/models/nope").status == 404  # type: ignore[union-attr]


def test_other_bodiless_requests_go_to_a_pod() -> None:
    fleet = Fleet()
    assert isinstance(fleet.gateway.route_bodiless("GET", "/health"), Routed)
    empty = Fleet(pools=())
    assert empty.gateway.route_bodiless("GET", "/health").status == 503  # type: ignore[union-attr]


def test_pod_bookkeeping_goes_to_the_pool_of_the_request() -> None:
    fleet = Fleet()
    fleet.view.endpoints["qwen"] = EndpointSet(pool="qwen", endpoints=(
        Endpoint("llama-0", "10.0.1.1", 8000),))  # the same pod name in both pools
    fleet.gateway.update(fleet.view, RegistryChanges(endpoints={"qwen"}))
    fleet.model("qwen", "q")
    routed = fleet.route("q")
    assert isinstance(routed, Routed)
    fleet.gateway.started(routed)
    assert fleet.gateway.table("qwen").in_flight() == {"llama-0": 1}  # type: ignore[union-attr]
    assert fleet.gateway.table("llama").in_flight() == {}  # type: ignore[union-attr]
    fleet.gateway.finished(routed)
    assert fleet.gateway.in_flight() == {}


def test_ten_thousand_models_index_incrementally() -> None:
    fleet = Fleet()
    for index in range(10_000):
        pool = "llama" if index % 2 else "qwen"
        fleet.view.apply(model_key(pool, f"m{index}"),
                         encode(InferenceModel(model_name=f"m{index}", pool=pool)))
    fleet.gateway.update(fleet.view, RegistryChanges(models={
        "llama": {f"m{i}" for i in range(1, 10_000, 2)},
        "qwen": {f"m{i}" for i in range(0, 10_000, 2)}}))
    assert len(fleet.gateway.owner) == 10_000
    assert pool_of(fleet.route("m9999")) == "llama"


def test_serving_every_pool_drops_a_pool_the_registry_removed() -> None:
    fleet = Fleet()
    for table in (fleet.view.pools, fleet.view.models, fleet.view.endpoints):
        table.pop("qwen")
    fleet.gateway.update(fleet.view, RegistryChanges(pools={"qwen"}, endpoints={"qwen"}))
    assert set(fleet.gateway.routers) == {"llama"}
    assert pool_of(fleet.route("anything")) == "llama"  # the only pool again: the default
