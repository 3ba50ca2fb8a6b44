"""``lig explain``: run a scheduling policy on pods and a request from files, show every step.

Pods file: a JSON list of objects with ``name`` (required), ``address``, ``waiting``, ``running``,
``kv_cache_usage`` (0..1), ``running_adapters``, ``waiting_adapters``, ``max_lora`` and
``in_flight``, ``unreported_tokens``, ``recent_tokens``, ``age`` and ``peer_lag`` (the load
estimate's and the near-tie margin's inputs, ``scheduling.types.PodView``). The pods are loaded into
a picker's ``PodTable`` as snapshots (with ``in_flight`` requests started on each), so the policy
sees the views the picker would build from them: a pod without ``max_lora`` (vLLM reports none
before its first step) gets the largest any pod reports. Request file: an object with ``model``,
optional ``target_model`` (defaults to ``model``) and ``criticality`` (Critical | Standard |
Sheddable, default Standard); for prompt-aware policies also ``prompt_tokens``, ``max_tokens``,
``prefix_blocks`` (how many blocks of the prompt were hashed) and ``prefix_hits`` (pod name ->
leading blocks the prefix index believes it holds). Scorer pipelines (``prefix-aware``) also show
every candidate's weighted total and each scorer's score.

``--recording FILE --request-id ID`` explains a recorded decision instead: the pods, request,
policy and random draw come from the flight record (``lig record``; docs/recording.md), and the
output is the same, plus the recorded pick, whether the re-run agrees, and the outcome.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec

from scheduling import (
    Decision,
    PodScore,
    PodView,
    PolicyConfigError,
    SchedulingRequest,
    StepTrace,
    build_policy,
    policy_names,
)
from services.picker.gray_pods import GrayPods
from services.picker.state import PodTable
from shared.schemas import DEFAULT_POLICY_NAME, Criticality, Endpoint, PodMetrics, PolicyConfig

NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
_SHOWN_NAMES = 8  # pod names listed per step in text output before "+N more"


class PodEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One pod of the pods file."""

    name: str
    address: str = ""
    waiting: NonNegativeInt = 0
    running: NonNegativeInt = 0
    kv_cache_usage: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    running_adapters: list[str] = []
    waiting_adapters: list[str] = []
    max_lora: NonNegativeInt | None = None
    in_flight: NonNegativeInt = 0
    unreported_tokens: NonNegativeInt = 0
    recent_tokens: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    age: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    peer_lag: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0


class RequestEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The request as the output echoes it."""

    model: str
    target_model: str | None = None
    criticality: Criticality = Criticality.STANDARD


class RequestFile(RequestEntry, frozen=True, forbid_unknown_fields=True):
    """The request file: the echoed fields plus what prompt-aware policies read."""

    prompt_tokens: NonNegativeInt = 0
    max_tokens: NonNegativeInt = 0
    prefix_blocks: NonNegativeInt = 0
    prefix_hits: dict[str, NonNegativeInt] = {}


class InputError(Exception):
    """A one-line message about a bad input file or flag."""


class ExplainOutput(msgspec.Struct):
    """What ``--json`` prints."""

    policy: str
    request: RequestEntry
    candidates: list[str]
    pick: str | None
    shed: bool
    steps: list[StepTrace]
    scores: list[PodScore] = []


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``lig explain``."""
    parser.add_argument("--pods", type=Path, help="JSON list of pods (required without "
                                                   "--recording)")
    parser.add_argument("--request", type=Path, help="JSON request object (required without "
                                                      "--recording)")
    parser.add_argument("--policy", default=argparse.SUPPRESS, choices=policy_names(),
                        help=f"scheduling policy (default: lig picker's, {DEFAULT_POLICY_NAME})")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seed", type=int, default=None, help="seed of the final random pick")
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="policy parameter (repeatable), e.g. queueing_threshold_lora=20; "
        "VALUE is read as JSON when it parses, else as a string",
    )
    recorded = parser.add_argument_group(
        "a recorded decision",
        "explain a decision of a recording ('lig record') instead of --pods/--request: its "
        "pods, request, policy and random draw are the recorded ones")
    recorded.add_argument("--recording", type=Path, metavar="FILE",
                          help="a recording written by 'lig record'")
    recorded.add_argument("--request-id", metavar="ID",
                          help="the request's x-request-id (Envoy returns it to the client); "
                               "exit 1 when the recording has no decision for it")


def run(args: argparse.Namespace) -> int:
    """Run the policy once and print the explanation; 2 on bad input, 1 for a request id the
    recording does not hold."""
    if args.recording is not None or args.request_id is not None:
        return _run_recorded(args)
    if args.pods is None or args.request is None:
        print("lig explain: --pods and --request are required (or --recording FILE "
              "--request-id ID)", file=sys.stderr)
        return 2
    try:
        pods = _read_pods(args.pods)
        request = _read(args.request, RequestFile)
        params = _parse_params(args.param)
        policy = build_policy(PolicyConfig(name=getattr(args, "policy", DEFAULT_POLICY_NAME),
                                           params=params), _rng(args.seed))
    except InputError as exc:
        print(f"lig explain: {exc}", file=sys.stderr)
        return 2
    except PolicyConfigError as exc:
        print(f"lig explain: --param: {exc}", file=sys.stderr)
        return 2
    scheduling_request = SchedulingRequest(
        model=request.model,
        target_model=request.target_model or request.model,
        criticality=request.criticality,
        prompt_tokens=request.prompt_tokens,
        max_tokens=request.max_tokens,
        # Stand-in hashes: a policy reads only how many blocks there are and the hits.
        prefix_hashes=tuple(range(request.prefix_blocks)),
        prefix_hits={pod: min(hits, request.prefix_blocks)
                     for pod, hits in request.prefix_hits.items()},
    )
    decision = policy.schedule(scheduling_request, pods, explain=True)
    resolved = RequestEntry(request.model, scheduling_request.target_model, request.criticality)
    if args.json:
        print(msgspec.json.encode(explain_output(policy.name, resolved, decision)).decode())
    else:
        print(render(policy.name, resolved, len(pods), decision))
    return 0


def _run_recorded(args: argparse.Namespace) -> int:
    # Imported here: the file-based explain does not pay for the recording reader.
    from lig.explain_recording import run_recorded

    given = [flag for flag, value in (("--pods", args.pods), ("--request", args.request),
                                      ("--policy", getattr(args, "policy", None)),
                                      ("--seed", args.seed is not None),
                                      ("--param", args.param)) if value]
    if given:
        print(f"lig explain: {given[0]} cannot be combined with --recording (the recording "
              "holds the pods, request, policy and draw)", file=sys.stderr)
        return 2
    if args.recording is None or args.request_id is None:
        print("lig explain: --recording and --request-id go together", file=sys.stderr)
        return 2
    return run_recorded(args.recording, args.request_id, args.json)


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


T = TypeVar("T")


def _read(path: Path, entry_type: type[T]) -> T:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        return msgspec.json.decode(data, type=entry_type)
    except msgspec.ValidationError as exc:
        message, _, where = str(exc).partition(" - at ")
        at = f" at {where.strip('`')}" if where else ""
        raise InputError(f"{path}{at}: {message}") from None
    except msgspec.DecodeError as exc:
        raise InputError(f"{path}: not valid JSON: {exc}") from None


def _read_pods(path: Path) -> list[PodView]:
    entries = _read(path, list[PodEntry])
    seen: set[str] = set()
    for index, entry in enumerate(entries):
        if entry.name in seen:
            raise InputError(f"{path} at $[{index}].name: duplicate pod name {entry.name!r}")
        seen.add(entry.name)
    return picker_views(entries)


def picker_views(entries: list[PodEntry]) -> list[PodView]:
    """The views a picker's ``PodTable`` builds from these pods as fresh snapshots, each with
    ``in_flight`` requests started; in file order, addresses as given."""
    # Snapshots scraped "now" (wall clock 0 = scrape time 0): every view is of age 0.
    table = PodTable(math.inf, clock=lambda: 0.0, load_estimate=False, gray=GrayPods(0, 0),
                     wall_clock=lambda: 0)
    table.set_endpoints(_endpoint(entry) for entry in entries)
    for entry in entries:
        table.apply(PodMetrics(
            pool="explain", pod=entry.name, address=_endpoint(entry).hostport, seq=1,
            scrape_time_ns=0, scrape_duration_s=0.0, ok=True, waiting=entry.waiting,
            running=entry.running, kv_cache_usage=entry.kv_cache_usage,
            running_adapters=tuple(entry.running_adapters),
            waiting_adapters=tuple(entry.waiting_adapters), max_lora=entry.max_lora))
        for _ in range(entry.in_flight):
            table.started(entry.name)
    by_name = {entry.name: entry for entry in entries}
    return [msgspec.structs.replace(view, address=(entry := by_name[view.name]).address,
                                    unreported_tokens=entry.unreported_tokens,
                                    recent_tokens=entry.recent_tokens, age=entry.age,
                                    peer_lag=entry.peer_lag)
            for view in table.fresh_views()]


def _endpoint(entry: PodEntry) -> Endpoint:
    host, colon, port = entry.address.rpartition(":")
    if colon and port.isdigit():
        return Endpoint(entry.name, host, int(port))
    return Endpoint(entry.name, entry.address, 0)


def _parse_params(items: list[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise InputError(f"--param {item!r}: expected KEY=VALUE")
        try:
            params[key] = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            params[key] = raw
    return params


def _rng(seed: int | None) -> random.Random:
    return random.Random(seed)


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
