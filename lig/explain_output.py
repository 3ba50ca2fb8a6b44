"""The explanation of one decision, as ``lig explain`` prints it: text, or the ``--json`` object.

Shared by the explanation of files (:mod:`lig.explain`) and of recorded decisions
(:mod:`lig.explain_recording`), so that both print a decision the same way.
"""

from __future__ import annotations

import msgspec

from scheduling import Decision, PodScore, StepTrace
from shared.schemas import Criticality

_SHOWN_NAMES = 8  # pod names listed per step in text output before "+N more"


class RequestEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The request as the output echoes it."""

    model: str
    target_model: str | None = None
    criticality: Criticality = Criticality.STANDARD


class ExplainOutput(msgspec.Struct):
    """What ``--json`` prints."""

    policy: str
    request: RequestEntry
    candidates: list[str]
    pick: str | None
    shed: bool
    steps: list[StepTrace]
    scores: list[PodScore] = []


def explain_output(policy: str, request: RequestEntry, decision: Decision) -> ExplainOutput:
    """What ``--json`` prints for one explained decision."""
    return ExplainOutput(
        policy=policy,
        request=request,
        candidates=[pod.name for pod in decision.candidates],
        pick=decision.pick.name if decision.pick else None,
        shed=decision.shed,
        steps=list(decision.steps),
        scores=list(decision.scores),
    )


def render(policy: str, request: RequestEntry, pod_count: int, decision: Decision) -> str:
    """The explanation as text: the request, each step, scores, candidates and the pick."""
    lines = [
        f"policy {policy} on {pod_count} pods; request model={request.model} "
        f"target_model={request.target_model} criticality={request.criticality.value}",
    ]
    if decision.steps:
        lines.append("path:")
        width = max(len(step.step) for step in decision.steps)
        for number, step in enumerate(decision.steps, start=1):
            outcome = f"{len(step.entered)} in -> {len(step.kept)} kept"
            kept = f" [{_names(step.kept)}]" if step.kept else ""
            lines.append(f"  {number:>2}. {step.step:<{width}}  {outcome}{kept}  {step.branch}")
    if decision.scores:
        lines.extend(_score_table(decision.scores))
    lines.append(f"candidates: {_names(tuple(pod.name for pod in decision.candidates)) or '-'}")
    if decision.pick is not None:
        lines.append(f"pick: {decision.pick.name} ({decision.pick.address or 'no address'})")
    elif decision.shed:
        lines.append("pick: none - shed (the picker answers 429)")
    elif pod_count == 0:
        lines.append("pick: none - no pods (the picker answers 503)")
    else:
        lines.append("pick: none - no candidate left (the picker answers 503)")
    return "\n".join(lines)


def _score_table(scores: tuple[PodScore, ...]) -> list[str]:
    """Scores per pod, best total first: ``pod  total  scorer=score ...``."""
    width = max(len(entry.pod) for entry in scores)
    lines = ["scores (weighted total; each scorer's score):"]
    for entry in sorted(scores, key=lambda entry: -entry.total):
        parts = "  ".join(f"{name}={value:.3f}" for name, value in entry.scores.items())
        lines.append(f"  {entry.pod:<{width}}  {entry.total:7.3f}  {parts}")
    return lines


def _names(names: tuple[str, ...]) -> str:
    shown = ", ".join(names[:_SHOWN_NAMES])
    hidden = len(names) - _SHOWN_NAMES
    return f"{shown}, +{hidden} more" if hidden > 0 else shown
