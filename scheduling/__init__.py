"""Scheduling: choose a model-server pod for a request from fresh per-pod metrics.

Entry point: ``build_policy(PolicyConfig, rng)`` returns a :class:`Policy` whose
``schedule(request, pods, explain=False)`` returns a :class:`Decision`.
"""

from scheduling.params import PolicyConfigError
from scheduling.policies import build_policy, policy_names
from scheduling.types import (
    Decision,
    PodScore,
    PodView,
    Policy,
    SchedulingRequest,
    StepTrace,
)

__all__ = [
    "Decision",
    "PodScore",
    "PodView",
    "Policy",
    "PolicyConfigError",
    "SchedulingRequest",
    "StepTrace",
    "build_policy",
    "policy_names",
]
