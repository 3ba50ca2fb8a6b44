"""The plugin registry: type name -> what it builds (filter, scorer, picker) and its factory."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from scheduling.params import PolicyConfigError
from scheduling.plugin import Filter, Picker, PluginType, Scorer
from scheduling.plugins import (
    can_accept_lora,
    critical_request,
    in_flight_scorer,
    kv_cache_load,
    least_kv_cache,
    least_queue,
    lora_affinity,
    lora_fit,
    low_lora_cost,
    low_queue,
    prefix_affinity,
    queue_load,
    random_picker,
    round_robin_picker,
    shed,
    sheddable_capacity,
    sheddable_gate,
    token_load,
    waiting_scorer,
)

PLUGINS: dict[str, PluginType] = {
    # filters
    "critical_request": PluginType("filter", critical_request.create),
    "low_queue": PluginType("filter", low_queue.create),
    "lora_affinity": PluginType("filter", lora_affinity.create),
    "can_accept_lora": PluginType("filter", can_accept_lora.create),
    "low_lora_cost": PluginType("filter", low_lora_cost.create),
    "least_queue": PluginType("filter", least_queue.create),
    "least_kv_cache": PluginType("filter", least_kv_cache.create),
    "sheddable_capacity": PluginType("filter", sheddable_capacity.create),
    "shed": PluginType("filter", shed.create),
    "sheddable_gate": PluginType("filter", sheddable_gate.create),
    # scorers
    "waiting": PluginType("scorer", waiting_scorer.create),
    "in_flight": PluginType("scorer", in_flight_scorer.create),
    "prefix_affinity": PluginType("scorer", prefix_affinity.create),
    "token_load": PluginType("scorer", token_load.create),
    "queue_load": PluginType("scorer", queue_load.create),
    "kv_cache_load": PluginType("scorer", kv_cache_load.create),
    "lora_fit": PluginType("scorer", lora_fit.create),
    # pickers
    "random": PluginType("picker", random_picker.create),
    "round_robin": PluginType("picker", round_robin_picker.create),
}


def create_plugin(
    type_name: str, params: Mapping[str, Any], rng: random.Random
) -> tuple[PluginType, Filter | Scorer | Picker]:
    """Build the plugin registered as ``type_name``; :class:`PolicyConfigError` if unknown."""
    entry = PLUGINS.get(type_name)
    if entry is None:
        raise PolicyConfigError(f"unknown plugin type {type_name!r} (known: {', '.join(PLUGINS)})")
    return entry, entry.factory(params, rng)
