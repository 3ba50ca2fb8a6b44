"""Fault runs under steady load through Envoy: kill NATS, the collector, a picker, the registry
(each SIGKILLed, then started again after ``outage`` seconds), stop a pod (SIGSTOP for
``pod_stop`` seconds, then SIGCONT), and turn a pod gray (``lig sim``'s gray fault: idle
metrics, completions never answered).

Every fault runs in its own window of steady load, and only after the whole stack is ready
again. A request is lost when it gets no 200 within the client timeout. For the gray pod the
share of requests the pickers route to it, after ``gray_warmup`` seconds, is measured from their
own counters (``lig_picker_requests_total`` by pod).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from resilience.load import LoadRun, Outcome, steady_load
from resilience.report import Figure
from resilience.stack import OwnedStack

KILLED = {"nats": "nats", "collector": "collector", "picker": "picker-0",
          "registry": "registry"}
FAULTS = (*KILLED, "pod-stop", "gray-pod")
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
    gray_seconds: float = 20.0  # seconds of load with one pod gray
    gray_warmup: float = 5.0  # seconds before its share is counted
    request_timeout: float = 20.0
    # lig up --response-timeout, Envoy's 504 for a silent pod: longer than ``pod_stop`` (a
    # stopped pod's requests finish when it resumes), shorter than ``request_timeout`` (the
    # gray pod's held requests are answered).
    response_timeout: float = 15.0
    ready_timeout: float = 60.0


def _lost_figures(fault: str, outcomes: list[Outcome]) -> list[Figure]:
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
                                           settings.request_timeout))


async def kill_and_restart(stack: OwnedStack, fault: str, settings: ChaosSettings) -> list[Figure]:
    """SIGKILL the fault's service under load, start it again after the outage."""
    run = LoadRun()
    load = _with_load(stack, settings, settings.before + settings.outage + settings.settle, run)
    await asyncio.sleep(settings.before)
    stack.kill(KILLED[fault])
    await asyncio.sleep(settings.outage)
    stack.restart(KILLED[fault])
    await load
    return _lost_figures(fault, run.outcomes)


async def pod_stop(stack: OwnedStack, settings: ChaosSettings) -> list[Figure]:
    """SIGSTOP one pod under load, SIGCONT it after ``pod_stop`` seconds."""
    run = LoadRun()
    load = _with_load(stack, settings, settings.before + settings.pod_stop + settings.settle, run)
    await asyncio.sleep(settings.before)
    stack.pause(STOPPED_POD, True)
    try:
        await asyncio.sleep(settings.pod_stop)
    finally:
        stack.pause(STOPPED_POD, False)
    await load
    return _lost_figures("pod-stop", run.outcomes)


async def routed_by_pod(urls: list[str]) -> Counter[str] | None:
    """Requests every picker routed, by pod, from their ``/metrics``; None if one is
    unreadable (a partial sum would distort the shares)."""
    counts: Counter[str] = Counter()
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        for url in urls:
            try:
                page = (await client.get(url)).text
            except httpx.HTTPError:
                return None
            for family in text_string_to_metric_families(page):
                for sample in family.samples:
                    if (sample.name == "lig_picker_requests_total"
                            and sample.labels.get("outcome") == "routed"):
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
        _lost_figures("gray-pod", run.outcomes)[1],  # answers naming another model
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
    return figures
