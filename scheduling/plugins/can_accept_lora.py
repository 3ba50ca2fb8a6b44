"""``can_accept_lora``: keep pods with a free adapter slot (upstream's
``canAcceptNewLoraPredicate``: fewer active adapters than ``max_lora``)."""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.plugin import PluginRecord
from scheduling.types import PodView, SchedulingRequest


def active_adapter_count(pod: PodView) -> int:
    """Adapters occupying a slot: running or waiting, each counted once.

    Builds a union only when the pod has waiting adapters, which is rare, so the hot path
    allocates nothing.
    """
    if pod.waiting_adapters:
        return len(pod.running_adapters | pod.waiting_adapters)
    return len(pod.running_adapters)


class CanAcceptLora:
    """Keep pods that have room to load another adapter."""

    __slots__ = ()

    def filter(self, request: SchedulingRequest, pods: Sequence[PodView]) -> Sequence[PodView]:
        """Keep the pods with ``active adapters < max_lora``."""
        return [pod for pod in pods if active_adapter_count(pod) < pod.max_lora]


PLUGIN = PluginRecord("can_accept_lora", "filter", CanAcceptLora)
