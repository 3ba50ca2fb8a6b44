"""The plugin catalog: every plugin type a tree step or policy can name, by its type name.

A plugin module declares one :class:`~scheduling.plugin.PluginRecord` named ``PLUGIN``; listing
that module in ``_MODULES`` below makes its type name usable in tree specs.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from scheduling.params import PolicyConfigError
from scheduling.plugin import Filter, Picker, PluginRecord, Scorer
from scheduling.plugins import (
    can_accept_lora,
    critical_request,
    in_flight_scorer,
    kv_cache_load,
    least_kv_cache,
    least_queue,
    least_work,
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

# Order is the order of the "known:" list in error messages: filters, scorers, pickers.
_MODULES = (
    critical_request,
    low_queue,
    lora_affinity,
    can_accept_lora,
    low_lora_cost,
    least_queue,
    least_kv_cache,
    sheddable_capacity,
    shed,
    sheddable_gate,
    waiting_scorer,
    in_flight_scorer,
    prefix_affinity,
    token_load,
    queue_load,
    kv_cache_load,
    lora_fit,
    random_picker,
    round_robin_picker,
    least_work,
)

PLUGIN_TYPES: dict[str, PluginRecord] = {module.PLUGIN.name: module.PLUGIN for module in _MODULES}


def create_plugin(
    type_name: str, params: Mapping[str, Any], rng: random.Random
) -> tuple[PluginRecord, Filter | Scorer | Picker]:
    """Build the plugin catalogued as ``type_name``; :class:`PolicyConfigError` if unknown."""
    record = PLUGIN_TYPES.get(type_name)
    if record is None:
        known = ", ".join(PLUGIN_TYPES)
        raise PolicyConfigError(f"unknown plugin type {type_name!r} (known: {known})")
    return record, record.build(params, rng)
