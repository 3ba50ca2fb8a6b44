"""``lora_affinity``: keep pods where the target model is already active (strong affinity).

Active means listed in the pod's running or waiting adapters, as upstream's later
``ActiveModels``/``WaitingModels`` check does: a waiting adapter is already being loaded there.
A base-model request (target not in any adapter list) matches no pod, as upstream.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.plugin import PluginRecord
from scheduling.types import PodView, SchedulingRequest


class LoraAffinity:
    """Keep pods whose running or waiting adapters include the request's target model."""

    __slots__ = ()

    def filter(self, request: SchedulingRequest, pods: Sequence[PodView]) -> Sequence[PodView]:
        """Keep the pods with the target adapter active."""
        target = request.target_model
        return [
            pod for pod in pods if target in pod.running_adapters or target in pod.waiting_adapters
        ]


PLUGIN = PluginRecord("lora_affinity", "filter", LoraAffinity)
