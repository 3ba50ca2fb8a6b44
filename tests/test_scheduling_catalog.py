"""The plugin catalog: every plugin module is catalogued, and records build plugins with checked
parameters whose errors name the plugin and the parameter."""

from __future__ import annotations

import importlib
import pkgutil
import random

import pytest

import scheduling.plugins
from scheduling import PodView, PolicyConfigError, SchedulingRequest
from scheduling.catalog import PLUGIN_TYPES, create_plugin
from shared.schemas import Criticality

PODS = [PodView(f"p{i}", f"p{i}:8000", waiting=i, kv_cache_usage=0.1 * i) for i in range(6)]
REQ = SchedulingRequest(model="m", target_model="m", criticality=Criticality.CRITICAL)


def test_every_plugin_module_declares_a_catalogued_record() -> None:
    for info in pkgutil.iter_modules(scheduling.plugins.__path__):
        module = importlib.import_module(f"scheduling.plugins.{info.name}")
        record = getattr(module, "PLUGIN", None)
        assert record is not None, f"{info.name} declares no PLUGIN record"
        assert PLUGIN_TYPES.get(record.name) is record, f"{info.name} is not in catalog._MODULES"


def test_known_list_keeps_filters_then_scorers_then_pickers() -> None:
    kinds = [record.kind for record in PLUGIN_TYPES.values()]
    assert kinds == sorted(kinds, key=["filter", "scorer", "picker"].index)
    with pytest.raises(PolicyConfigError, match=r"\(known: critical_request, low_queue, "):
        create_plugin("nope", {}, random.Random(0))


@pytest.mark.parametrize(
    ("type_name", "params", "message"),
    [
        ("shed", {"x": 1}, "plugin 'shed': unknown parameter 'x' (known: none)"),
        ("random", {"seed": 1}, "plugin 'random': unknown parameter 'seed' (known: none)"),
        ("low_queue", {"threshold": "5"}, "plugin 'low_queue': parameter 'threshold': "),
        ("low_queue", {"threshold": -1}, "plugin 'low_queue': parameter 'threshold': "),
        ("sheddable_capacity", {"kv_cache_threshold": True},
         "plugin 'sheddable_capacity': parameter 'kv_cache_threshold': "),
    ],
)
def test_bad_params_name_the_plugin_and_the_parameter(type_name, params, message) -> None:
    with pytest.raises(PolicyConfigError) as caught:
        create_plugin(type_name, params, random.Random(0))
    assert str(caught.value).startswith(message)


def test_params_reach_the_constructor() -> None:
    _, strict = create_plugin("low_queue", {"threshold": 2}, random.Random(0))
    assert [pod.name for pod in strict.filter(REQ, PODS)] == ["p0", "p1"]
    _, default = create_plugin("low_queue", {}, random.Random(0))
    assert len(default.filter(REQ, PODS)) == 6  # default threshold 50
    record, capacity = create_plugin(
        "sheddable_capacity", {"queue_threshold": 4, "kv_cache_threshold": 0.25}, random.Random(0)
    )
    assert record.kind == "filter"
    assert [pod.name for pod in capacity.filter(REQ, PODS)] == ["p0", "p1", "p2"]


def test_the_policy_rng_reaches_plugins_that_take_it() -> None:
    picks = []
    for _ in range(2):
        _, picker = create_plugin("random", {}, random.Random(7))
        picks.append([picker.pick(REQ, PODS).name for _ in range(20)])
    assert picks[0] == picks[1]
    assert len(set(picks[0])) > 1
