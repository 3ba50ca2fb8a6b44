"""``lora_fit``: LoRA affinity as a score: 1 where the target adapter is active (running or
waiting, as ``lora_affinity``), 0.5 where a free slot can load it (as ``can_accept_lora``), 0
elsewhere. A base-model request matches no adapter list, so pods with free slots rank first, as
in the filter tree."""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.plugin import PluginRecord
from scheduling.plugins.can_accept_lora import active_adapter_count
from scheduling.types import PodView, SchedulingRequest


class LoraFit:
    """Score 1 (adapter active), 0.5 (room to load it) or 0."""

    __slots__ = ()

    def score(self, request: SchedulingRequest, pods: Sequence[PodView]) -> list[float]:
        """One score per pod: 1, 0.5 or 0."""
        target = request.target_model
        # Waiting adapters are rare: count slots without a call unless there are some.
        return [1.0 if target in pod.running_adapters or target in pod.waiting_adapters
                else 0.5 if (active_adapter_count(pod) if pod.waiting_adapters
                             else len(pod.running_adapters)) < pod.max_lora
                else 0.0
                for pod in pods]


PLUGIN = PluginRecord("lora_fit", "scorer", LoraFit)
