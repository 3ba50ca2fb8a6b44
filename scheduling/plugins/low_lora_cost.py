"""``low_lora_cost``: keep pods where serving the target is cheap: the adapter is active or the
pod has a free slot (upstream's ``lowLoRACostPredicate``, weak affinity that spreads an adapter's
load over several pods)."""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.plugin import PluginRecord
from scheduling.plugins.can_accept_lora import active_adapter_count
from scheduling.types import PodView, SchedulingRequest


class LowLoraCost:
    """Keep pods with the target adapter active or room to load it."""

    __slots__ = ()

    def filter(self, request: SchedulingRequest, pods: Sequence[PodView]) -> Sequence[PodView]:
        """Keep the pods that can serve the target without evicting an adapter."""
        target = request.target_model
        return [
            pod
            for pod in pods
            if target in pod.running_adapters
            or target in pod.waiting_adapters
            or active_adapter_count(pod) < pod.max_lora
        ]


PLUGIN = PluginRecord("low_lora_cost", "filter", LowLoraCost)
