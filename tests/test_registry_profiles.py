"""The registry validates scheduler profiles (``prefix-aware``) by building them, per pool."""

from __future__ import annotations

import pytest

from services.registry.files import FileSnapshot, SourceFile, load
from services.registry.loader import InvalidRegistry
from tests.support.registry_yaml import dump, pool

PROFILE = {
    "policy": "prefix-aware",
    "params": {
        "filters": [{"plugin": "sheddable_gate", "params": {"queue_threshold": 3}}],
        "scorers": [{"plugin": "prefix_affinity", "weight": 3, "params": {"load_margin": 4}},
                    {"plugin": "token_load", "params": {"token_scale": 8192}},
                    {"plugin": "queue_load"}],
        "picker": "round_robin",
    },
}


def test_a_pool_may_compose_its_profile() -> None:
    registry = load(FileSnapshot((SourceFile("x.yaml", dump(pool(scheduling=PROFILE))),)))
    policy = registry.pools[0].policy
    assert policy.name == "prefix-aware"
    assert policy.params["scorers"][0] == {"plugin": "prefix_affinity", "weight": 3,
                                           "params": {"load_margin": 4}}


@pytest.mark.parametrize("params, message", [
    ({"scorers": [{"plugin": "prefix_affinity", "weight": -2}]}, "scorers"),
    ({"scorers": [{"plugin": "prefix_afinity"}]}, "unknown plugin type 'prefix_afinity'"),
    ({"filters": [{"plugin": "token_load"}]}, "is a scorer"),
    ({"scorers": [{"plugin": "prefix_affinity", "params": {"margin": 1}}]},
     "unknown parameter 'margin'"),
])
def test_a_bad_profile_is_refused_at_spec_scheduling(params: dict, message: str) -> None:
    document = pool(scheduling={"policy": "prefix-aware", "params": params})
    with pytest.raises(InvalidRegistry) as caught:
        load(FileSnapshot((SourceFile("x.yaml", dump(document)),)))
    problems = list(caught.value.problems)
    assert len(problems) == 1
    assert "spec.scheduling" in str(problems[0]) and message in str(problems[0])
