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
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec

from lig.explain_output import RequestEntry, explain_output, render
from scheduling import (
    PodView,
    PolicyConfigError,
    SchedulingRequest,
    build_policy,
    policy_names,
)
from services.picker.gray_pods import GrayPods
from services.picker.state import PodTable
from shared.errors import ConfigError, InputError
from shared.schemas import DEFAULT_POLICY_NAME, Endpoint, PodMetrics, PolicyConfig

NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]


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


class RequestFile(RequestEntry, frozen=True, forbid_unknown_fields=True):
    """The request file: the echoed fields plus what prompt-aware policies read."""

    prompt_tokens: NonNegativeInt = 0
    max_tokens: NonNegativeInt = 0
    prefix_blocks: NonNegativeInt = 0
    prefix_hits: dict[str, NonNegativeInt] = {}


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
    """Run the policy once and print the explanation. Raises :class:`ConfigError` or
    :class:`InputError` (exit 2) on bad flags or files; for a recorded decision see
    :func:`lig.explain_recording.run_recorded`."""
    if args.recording is not None or args.request_id is not None:
        return _run_recorded(args)
    if args.pods is None or args.request is None:
        raise ConfigError("--pods and --request are required (or --recording FILE "
                          "--request-id ID)")
    pods = _read_pods(args.pods)
    request = _read(args.request, RequestFile)
    params = _parse_params(args.param)
    try:
        policy = build_policy(PolicyConfig(name=getattr(args, "policy", DEFAULT_POLICY_NAME),
                                           params=params), _rng(args.seed))
    except PolicyConfigError as exc:
        raise ConfigError(f"--param: {exc}") from None
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
        raise ConfigError(f"{given[0]} cannot be combined with --recording (the recording "
                          "holds the pods, request, policy and draw)")
    if args.recording is None or args.request_id is None:
        raise ConfigError("--recording and --request-id go together")
    return run_recorded(args.recording, args.request_id, args.json)


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
            raise ConfigError(f"--param {item!r}: expected KEY=VALUE")
        try:
            params[key] = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            params[key] = raw
    return params


def _rng(seed: int | None) -> random.Random:
    return random.Random(seed)
