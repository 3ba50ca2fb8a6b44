"""Fault runs under steady load through Envoy: kill NATS, the collector, a picker, the registry,
``lig kv-events``, or a picker while rewritten streams are in flight (each SIGKILLed, then
started again after ``outage`` seconds), stop a pod (SIGSTOP for ``pod_stop`` seconds, then
SIGCONT), and turn a pod gray (``lig sim``'s gray fault: idle metrics, completions never
answered).

Every fault runs in its own window of steady load (issue 26's mix: short completions, chats
sharing a 2,000-token system prompt, streams), and only after the whole stack is ready again. A
request is lost when it gets no 200 within the client timeout (or its stream is cut). For the
gray pod the share of requests the pickers route to it, after ``gray_warmup`` seconds, is
measured from their own counters (``lig_picker_requests_total`` by pod).

With the stack's block witness (:mod:`resilience.witness`), each kill and the pod stop are also
judged by what the pickers believe: ``index_check`` seconds after the fault's end, under load,
each picker's precise index (``lig_picker_precise_blocks``) must be within 2% of the pods' true
block sets, or the picker must say that it is not (``lig_picker_precise_incomplete_pods`` > 0).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import msgspec

from resilience.load import KV_MIX, LoadRun, Outcome, steady_load
from resilience.picker_metrics import picker_samples
from resilience.procinfo import rss_bytes
from resilience.report import Figure
from resilience.stack import OwnedStack
from resilience.witness import WitnessReport

KILLED = {"nats": "nats", "collector": "collector", "picker": "picker-0",
          "registry": "registry", "kv-events": "kv-events", "picker-streams": "picker-0"}
FAULTS = (*KILLED, "pod-stop", "gray-pod")
REPLAY_BUFFER = 50
"""KV-event batches a chaos stack's pod keeps for replays: about 2 s of this load, so that a
restarted ``lig kv-events`` finds the buffers rolled over (issue 26's case; vLLM's 10,000
batches take minutes to roll over)."""
STREAM_POLL = 0.01  # seconds between looks at the streams in flight
INDEX_TOLERANCE_PCT = 2.0  # issue 26: a picker's precise index within 2% of the true block sets
STOPPED_POD = "sim-0"
GRAY_HELD_STATUS = 504  # Envoy's answer once a pod stays silent for the response timeout
GRAY_SHARE_TARGET_PCT = 2.0


class ChaosSettings(msgspec.Struct, frozen=True):
    """Which faults, and the load and timing around each (all bounded)."""

    faults: tuple[str, ...] = FAULTS
    rate: float = 100.0  # requests/s through Envoy
    before: float = 2.0  # seconds of load before the fault
    outage: float = 5.0  # seconds a killed service stays down
    pod_stop: float = 10.0  # seconds a pod stays stopped
    settle: float = 5.0  # seconds of load after recovery
    index_check: float = 10.0  # seconds after a fault's end the pickers' indexes are judged
    streams_in_flight: int = 5  # rewritten streams picker-streams waits for before its kill
    gray_seconds: float = 20.0  # seconds of load with one pod gray
    gray_warmup: float = 5.0  # seconds before its share is counted
    request_timeout: float = 20.0
    # lig up --response-timeout, Envoy's 504 for a silent pod: longer than ``pod_stop`` (a
    # stopped pod's requests finish when it resumes), shorter than ``request_timeout`` (the
    # gray pod's held requests are answered).
    response_timeout: float = 15.0
    ready_timeout: float = 60.0


def lost_figures(fault: str, outcomes: list[Outcome]) -> list[Figure]:
    """Requests lost and answers naming another model among ``outcomes`` (both target 0)."""
    lost = LoadRun.lost(outcomes)
    wrong = LoadRun.wrong_model(outcomes)
    causes = LoadRun.causes(lost)
    return [
        Figure(fault, "requests lost", f"{len(lost)} of {len(outcomes)} at "
                                       f"{LoadRun.achieved_rate(outcomes):.0f} req/s"
                                       + (f" ({causes})" if causes else ""),
               "0", bool(outcomes) and not lost),
        Figure(fault, "answers naming another model", f"{len(wrong)}", "0", not wrong),
    ]


def _with_load(stack: OwnedStack, settings: ChaosSettings, seconds: float,
               run: LoadRun) -> asyncio.Task[LoadRun]:
    """Start ``seconds`` of steady load through the stack's Envoy, recorded in ``run``."""
    return asyncio.create_task(steady_load(stack.target.gateway, settings.rate, seconds, run,
                                           settings.request_timeout, KV_MIX))


def _after_fault(stack: OwnedStack, settings: ChaosSettings) -> float:
    """Seconds of load after a fault's end: the settling time, and with a witness at least
    until the indexes are judged (they are judged under load)."""
    if stack.witness is None:
        return settings.settle
    return max(settings.settle, settings.index_check + 1.0)


async def _streams_in_flight(run: LoadRun, wanted: int, within: float) -> int:
    """Wait (at most ``within`` s) until ``wanted`` split-model streams are in flight; how many
    are."""
    for _ in range(int(within / STREAM_POLL)):
        if run.split_streams >= wanted:
            break
        await asyncio.sleep(STREAM_POLL)
    return run.split_streams


async def kill_and_restart(stack: OwnedStack, fault: str, settings: ChaosSettings) -> list[Figure]:
    """SIGKILL the fault's service under load, start it again after the outage."""
    run = LoadRun()
    before = await _snapshot(stack)
    load = _with_load(stack, settings, settings.before + settings.outage
                      + _after_fault(stack, settings), run)
    figures: list[Figure] = []
    await asyncio.sleep(settings.before)
    if fault == "picker-streams":
        # The rewrite of a stream's chunks runs on the picker that routed it: kill one with
        # such streams in flight (spread over both pickers by Envoy).
        streams = await _streams_in_flight(run, settings.streams_in_flight, settings.before)
        figures.append(Figure(fault, "rewritten streams in flight at the kill",
                              f"{streams} (over all pickers)"))
    stack.kill(KILLED[fault])
    await asyncio.sleep(settings.outage)
    stack.restart(KILLED[fault])
    figures += await _judge_indexes(stack, fault, settings, time.monotonic(), before)
    await load
    return [*lost_figures(fault, run.outcomes), *figures]


async def pod_stop(stack: OwnedStack, settings: ChaosSettings) -> list[Figure]:
    """SIGSTOP one pod under load, SIGCONT it after ``pod_stop`` seconds."""
    run = LoadRun()
    before = await _snapshot(stack)
    load = _with_load(stack, settings, settings.before + settings.pod_stop
                      + _after_fault(stack, settings), run)
    await asyncio.sleep(settings.before)
    stack.pause(STOPPED_POD, True)
    try:
        await asyncio.sleep(settings.pod_stop)
    finally:
        stack.pause(STOPPED_POD, False)
    figures = await _judge_indexes(stack, "pod-stop", settings, time.monotonic(), before)
    await load
    return [*lost_figures("pod-stop", run.outcomes), *figures]


Rss = dict[str, tuple[int | None, int | None]]  # picker -> its pid and resident bytes
State = tuple[int, int] | None  # a picker's precise blocks and incomplete pods (None: unreadable)


class IndexSnapshot(msgspec.Struct, frozen=True):
    """What the pickers believe and what the pods hold, at one moment."""

    states: dict[str, State]  # picker -> its precise index's state
    truths: dict[str, int]  # picker -> the witness's blocks over every pod as it was read
    rss: Rss


def _pickers_rss(stack: OwnedStack) -> Rss:
    """Each picker's pid and resident bytes now."""
    return {p.name: (p.pid, rss_bytes(p.pid) if p.pid else None) for p in stack.target.pickers}


def _rss_figure(fault: str, before: Rss, after: Rss) -> Figure:
    """The pickers' memory at the window's start and at the index check (context only)."""
    def mib(value: int | None) -> str:
        return "?" if value is None else f"{value / (1 << 20):.0f}"

    parts = []
    for name, (pid, rss) in after.items():
        first_pid, first_rss = before.get(name, (None, None))
        parts.append(f"{name} {mib(first_rss)} -> {mib(rss)} MiB"
                     + (" (restarted)" if pid != first_pid else ""))
    return Figure(fault, "picker RSS at the start -> at the check", "; ".join(parts))


async def precise_state(url: str) -> State:
    """A picker's precise index over its pools from its ``/metrics``: blocks held and pods
    marked incomplete; None when it cannot be read."""
    samples = await picker_samples(url)
    if samples is None:
        return None
    blocks = incomplete = 0
    for sample in samples:
        if sample.name == "lig_picker_precise_blocks":
            blocks += int(sample.value)
        elif sample.name == "lig_picker_precise_incomplete_pods":
            incomplete += int(sample.value)
    return blocks, incomplete


async def _snapshot(stack: OwnedStack) -> IndexSnapshot | None:
    """Every picker's precise index, the witness's truth and the pickers' memory (None without
    a witness)."""
    if stack.witness is None:
        return None
    witness = stack.witness
    states: dict[str, State] = {}
    truths: dict[str, int] = {}
    for picker in stack.target.pickers:
        # The truth moves with the load (hundreds of blocks a second): each picker is judged
        # against it as it was while that picker's metrics were read, not before or after the
        # other pickers' reads.
        first = witness.report().total
        states[picker.name] = (await precise_state(picker.metrics_url) if picker.metrics_url
                               else None)
        truths[picker.name] = (first + witness.report().total) // 2
    return IndexSnapshot(states, truths, _pickers_rss(stack))


def _off(blocks: int, truth: int) -> float:
    """How far ``blocks`` is from ``truth``, in percent of it (100 when only the truth is 0)."""
    return 100.0 * (blocks - truth) / truth if truth else (0.0 if blocks == 0 else 100.0)


def index_figure(fault: str, picker: str, state: State, truth: int, after: float,
                 before: State = None, truth_before: int = 0) -> Figure:
    """One picker's index against the truth: PASS when within the tolerance (or both empty),
    or when the picker marks pods incomplete; the value says which held, and how far off the
    picker was before the fault (``before``, when known: an earlier fault's aftermath)."""
    name = f"{picker} precise index {after:g} s after the fault"
    target = f"within {INDEX_TOLERANCE_PCT:g}% or pods incomplete"
    if state is None:
        return Figure(fault, name, "metrics unreadable", target, False)
    blocks, incomplete = state
    off = _off(blocks, truth)
    within = abs(off) <= INDEX_TOLERANCE_PCT
    held = ("within" if within else "") + (" + " if within and incomplete else "") + (
        "incomplete" if incomplete else "")
    earlier = ("" if before is None else
               f" (before the fault: {_off(before[0], truth_before):+.1f}%, {before[1]} "
               "incomplete)")
    return Figure(fault, name, f"{blocks} of {truth} true blocks ({off:+.1f}%), "
                               f"{incomplete} pods incomplete: {held or 'neither'}{earlier}",
                  target, within or incomplete > 0)


async def _judge_indexes(stack: OwnedStack, fault: str, settings: ChaosSettings, ended: float,
                         before: IndexSnapshot | None) -> list[Figure]:
    """``index_check`` s after the fault ended at ``ended``: every picker's precise index against
    the witness's true total, and the pickers' memory, beside their state ``before`` the fault
    (nothing without a witness)."""
    if before is None:
        return []
    await asyncio.sleep(max(0.0, ended + settings.index_check - time.monotonic()))
    after = await _snapshot(stack)
    assert after is not None  # the same witness as before
    return [*(index_figure(fault, name, state, after.truths[name], settings.index_check,
                           before.states.get(name), before.truths.get(name, 0))
              for name, state in after.states.items()),
            _rss_figure(fault, before.rss, after.rss)]


async def routed_by_pod(urls: list[str]) -> Counter[str] | None:
    """Requests every picker routed, by pod, from their ``/metrics``; None if one is
    unreadable (a partial sum would distort the shares)."""
    counts: Counter[str] = Counter()
    for url in urls:
        samples = await picker_samples(url)
        if samples is None:
            return None
        for sample in samples:
            if sample.name == "lig_picker_requests_total" \
                    and sample.labels.get("outcome") == "routed":
                counts[sample.labels.get("pod", "")] += int(sample.value)
    return counts


async def _set_gray(pod_url: str, mode: str) -> None:
    """Make a simulated pod gray (``hang``: idle metrics, completions held), or heal it (``""``)."""
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        (await client.post(f"{pod_url}/admin/faults", json={"gray": mode})).raise_for_status()


async def gray_pod(stack: OwnedStack, settings: ChaosSettings) -> list[Figure]:
    """Turn pod 0 gray under load (``lig sim``'s gray fault: its metrics stay idle while its
    completions hang); measure its share of traffic once the pickers had ``gray_warmup``
    seconds, and how the requests it held ended."""
    pod = stack.plan.pods[0]
    pod_url = f"http://{pod.address}:{pod.port}"
    urls = [p.metrics_url for p in stack.target.pickers if p.metrics_url]
    run = LoadRun()
    load = _with_load(stack, settings, settings.before + settings.gray_seconds, run)
    try:
        await asyncio.sleep(settings.before)
        await _set_gray(pod_url, "hang")
        await asyncio.sleep(settings.gray_warmup)
        warm = await routed_by_pod(urls)
        await asyncio.sleep(max(0.0, settings.gray_seconds - settings.gray_warmup))
        end = await routed_by_pod(urls)
        await load
    finally:
        await _set_gray(pod_url, "")
        if not load.done():
            load.cancel()
    # Requests at the pod when it turns gray, and those routed to it before the pickers see it,
    # cannot succeed: they must be answered (504 once the pod was silent for the response
    # timeout), never left hanging, and no other request may fail.
    failed = LoadRun.lost(run.outcomes)
    held = [o for o in failed if o.status == GRAY_HELD_STATUS]
    figures = [
        Figure("gray-pod", "requests held by it, answered 504 after the response timeout",
               f"{len(held)} of {len(run.outcomes)}", ""),
        Figure("gray-pod", "other failures (no answer, or another status)",
               f"{len(failed) - len(held)}"
               + (f" ({LoadRun.causes([o for o in failed if o not in held])})"
                  if len(failed) > len(held) else ""), "0", len(failed) == len(held)),
        lost_figures("gray-pod", run.outcomes)[1],  # answers naming another model
    ]
    if warm is None or end is None:
        return [Figure("gray-pod", "pickers' request counters", "unreadable", "readable",
                       False), *figures]
    delta = end - warm
    total = sum(delta.values())
    share = 100.0 * delta[pod.name] / total if total else 0.0
    return [
        Figure("gray-pod", f"share routed to it after {settings.gray_warmup:g} s",
               f"{share:.1f}% ({delta[pod.name]}/{total})",
               f"< {GRAY_SHARE_TARGET_PCT:g}%", total > 0 and share < GRAY_SHARE_TARGET_PCT),
        *figures,
    ]


async def run_chaos(stack: OwnedStack, settings: ChaosSettings) -> list[Figure]:
    """Each fault in turn, each starting from a ready stack."""
    figures: list[Figure] = []
    for fault in settings.faults:
        not_ready = await stack.wait_ready(settings.ready_timeout)
        if not_ready is not None:
            figures.append(Figure(fault, "stack ready before the fault", not_ready.splitlines()[0],
                                  "yes", False))
            break
        if fault in KILLED:
            figures += await kill_and_restart(stack, fault, settings)
        elif fault == "pod-stop":
            figures += await pod_stop(stack, settings)
        else:
            figures += await gray_pod(stack, settings)
        died = stack.unexpected_exit()
        if died is not None:
            figures.append(Figure(fault, "no service died unasked", died.splitlines()[0],
                                  "none", False))
            break
    if stack.witness is not None:
        figures.append(witness_figure(stack.witness.report()))
    return figures


def witness_figure(report: WitnessReport) -> Figure:
    """Whether the witness heard every batch of every pod (else its truth is not the truth)."""
    missed = sum(report.missed.values())
    restarts = sum(report.restarts.values())
    return Figure("witness", "KV-event batches heard / missed",
                  f"{report.batches} / {missed}, {report.total} blocks now"
                  + (f", {restarts} engine restarts" if restarts else "")
                  + (f", {report.undecodable} undecodable" if report.undecodable else ""),
                  "0 missed", missed == 0 and report.undecodable == 0)
