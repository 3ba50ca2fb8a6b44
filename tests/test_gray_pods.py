"""Gray pods: the guard's logic on a fake clock, then a whole ``lig up`` stack with one gray pod.

The end-to-end test runs ``lig up`` as a user would (NATS, registry, collector, two pickers,
Envoy, four simulated pods), with pod 0 gray (``lig sim --gray-pod 0``): its ``/metrics`` shows
an idle pod while its completions hang (or fail at once). Under a bounded load through Envoy,
once every picker has left it out, the pickers send it less than 2% of the next requests, and
no request waits longer than the response timeout (``lig up --response-timeout``).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lig.status import PICKER_REQUESTS_FAMILY
from scheduling.types import PodView
from services.picker.gray_pods import BASE_COOL_OFF, GrayPods
from tests.support.envoy import EnvoyProcess
from tests.support.fleet_feed import FleetFeed
from tests.support.lig_up import RunningStack, lig_up
from tests.support.nats_server import NatsServer
from tests.support.picker import PickerProcess
from tests.support.simulator import SimulatedPods
from tests.support.waiting import wait_until

IDLE = {"a": PodView("a", "10.0.0.1:8000"), "b": PodView("b", "10.0.0.2:8000")}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0


def test_requests_older_than_the_pod_admits_make_it_gray_until_a_probe_succeeds() -> None:
    guard = GrayPods(gray_after=2.0, sample_every=0)
    clock = Clock()
    guard.started("a", clock.now)
    views = list(IDLE.values())
    clock.now += 1.9
    assert guard.excluded(views, clock.now) == set()  # not old yet
    clock.now += 0.2
    busy = PodView("a", "10.0.0.1:8000", running=1)
    assert guard.excluded([busy, IDLE["b"]], clock.now) == set()  # the pod runs it: fine
    assert guard.excluded(views, clock.now) == {"a"}  # idle, yet our request is not done
    guard.finished("a")
    clock.now += BASE_COOL_OFF - 0.1
    assert guard.excluded(views, clock.now) == {"a"}  # cool-off
    assert not guard.wants_outcome(clock.now)
    clock.now += 0.2
    assert guard.excluded(views, clock.now) == set()  # probation: one request at a time
    assert guard.wants_outcome(clock.now)  # a probe reports its status
    guard.started("a", clock.now)
    assert not guard.wants_outcome(clock.now)
    assert guard.excluded(views, clock.now) == {"a"}
    guard.responded("a", 200, clock.now)
    guard.finished("a")
    assert guard.excluded(views, clock.now) == set()
    guard.started("a", clock.now)
    assert guard.excluded(views, clock.now) == set()  # cleared: no longer one at a time
    assert not guard.wants_outcome(clock.now)


def test_mostly_5xx_makes_a_pod_gray_and_a_failed_probe_doubles_the_cool_off() -> None:
    exclusions: list[tuple[str, str]] = []
    guard = GrayPods(gray_after=0, sample_every=2,
                     on_exclude=lambda pod, reason: exclusions.append((pod, reason)))
    clock = Clock()
    assert [guard.wants_outcome(clock.now) for _ in range(4)] == [False, True, False, True]
    views = list(IDLE.values())
    guard.responded("a", 500, clock.now)
    guard.responded("a", 200, clock.now)
    assert guard.excluded(views, clock.now) == set()
    guard.responded("a", 503, clock.now)
    assert guard.excluded(views, clock.now) == {"a"}  # 2 of 3
    assert exclusions == [("a", "5xx")]
    clock.now += BASE_COOL_OFF + 0.1
    assert guard.excluded(views, clock.now) == set()
    guard.responded("a", 500, clock.now)  # the probe fails: out again, for twice as long
    clock.now += 2 * BASE_COOL_OFF - 0.1
    assert guard.excluded(views, clock.now) == {"a"}
    clock.now += 0.2
    assert guard.excluded(views, clock.now) == set()
    assert [guard.wants_outcome(clock.now) for _ in range(2)] == [True, True]  # a may probe
    guard.forget({"b"})  # "a" left the pool: back to one request in two
    assert sorted(guard.wants_outcome(clock.now) for _ in range(2)) == [False, True]


def test_envoy_outlier_detection_does_not_steer_original_dst(
        tmp_path: Path, nats_server: NatsServer, simulated_pods: Callable[..., SimulatedPods],
        picker_process: Callable[..., PickerProcess],
        envoy_gateway: Callable[..., EnvoyProcess]) -> None:
    """Why the pickers must leave gray pods out: Envoy ejects a pod answering 5xx, yet its
    ORIGINAL_DST cluster goes on sending it what the destination header names."""
    pods = simulated_pods(1, time_scale=20)
    pods.set_faults(0, failure_rate=1.0)
    feed = FleetFeed(nats_server.url, "pool", interval=0.1).start()
    try:
        feed.set_pool()
        feed.set_endpoints({"failing": pods.address(0)})
        feed.set_many({"failing": (pods.address(0), {"waiting": 0, "running": 0})})
        picker = picker_process("pool", nats_server.url, extra_args=(
            "--gray-after", "0", "--outcome-sample", "0"))  # the picker's own guard off
        picker.wait_ready()

        def outlier_detection(config: dict[str, Any]) -> None:
            cluster = next(c for c in config["static_resources"]["clusters"]
                           if c["name"] == "model_servers")
            cluster["outlier_detection"] = {"consecutive_5xx": 3, "interval": "0.2s",
                                            "base_ejection_time": "30s",
                                            "max_ejection_percent": 100}

        envoy = envoy_gateway([picker.endpoint], outlier_detection)
        body = {"model": "sim-model", "prompt": "x", "max_tokens": 1}
        with httpx.Client(base_url=envoy.url, timeout=5) as client:
            assert [client.post("/v1/completions", json=body).status_code
                    for _ in range(5)] == [500] * 5
            wait_until(lambda: envoy.stats("cluster.model_servers.outlier_detection")[
                "cluster.model_servers.outlier_detection.ejections_active"] == 1,
                what="the failing pod ejected")
            assert [client.post("/v1/completions", json=body).status_code
                    for _ in range(5)] == [500] * 5  # still sent there
    finally:
        feed.stop()


def routed_by_pod(stack: RunningStack) -> Counter[str]:
    """Requests both pickers routed, by pod."""
    counts: Counter[str] = Counter()
    for url in stack.info.picker_metrics:
        page = httpx.get(url, timeout=5).text
        for family in text_string_to_metric_families(page):
            if family.name != PICKER_REQUESTS_FAMILY:
                continue
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels["outcome"] == "routed":
                    counts[sample.labels["pod"]] += int(sample.value)
    return counts


def exclusions_by_picker(stack: RunningStack) -> list[set[str]]:
    """Per picker, the pods it counted as gray (lig_picker_gray_exclusions_total)."""
    by_picker = []
    for url in stack.info.picker_metrics:
        pods = set()
        for family in text_string_to_metric_families(httpx.get(url, timeout=5).text):
            if family.name == "lig_picker_gray_exclusions":
                pods |= {s.labels["pod"] for s in family.samples
                         if s.name.endswith("_total") and s.value > 0}
        by_picker.append(pods)
    return by_picker


def exclusions(stack: RunningStack) -> set[str]:
    """Pods some picker counted as gray."""
    return set().union(*exclusions_by_picker(stack))


@pytest.fixture(params=["hang", "error"])
def gray_stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RunningStack]:
    """``lig up`` on free ports with pod 0 gray."""
    with lig_up(tmp_path / "state", "--response-timeout", "3.0", "--sim-args",
                f"--gray-pod 0 --gray-mode {request.param} --time-scale 20") as stack:
        yield stack


@pytest.mark.timeout(180)
def test_a_gray_pod_loses_its_traffic_within_seconds(gray_stack: RunningStack) -> None:
    # Judged on the requests answered after every picker has left the gray pod out (each judges
    # on its own requests), counted rather than timed: a fixed 5 s warm-up was the whole
    # allowance for noticing it, and a loaded machine (a hang blocks a client for 3 s) can
    # take longer without the pickers being wrong. How soon is bounded generously below.
    clients, judged, max_requests = 6, 600, 6_000
    # Paced: 6 x 20 requests/s is plenty to judge a 2% share on (hundreds in the window), and
    # a closed loop (~300/s) cost this machine 25 s of CPU per run for nothing more.
    pace = 0.05
    results: list[tuple[int, float, str]] = []
    stop = threading.Event()
    body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": "hi", "max_tokens": 4}

    def client() -> None:
        with httpx.Client(base_url=gray_stack.gateway, timeout=15) as http:
            while not stop.wait(pace) and len(results) < max_requests:
                started = time.monotonic()
                try:
                    response = http.post("/v1/completions", json=body)
                except httpx.TimeoutException:  # the client gave up: a hang
                    results.append((0, time.monotonic() - started, "client timeout"))
                    continue
                code = "" if response.status_code == 200 else str(response.json()["error"]["code"])
                results.append((response.status_code, time.monotonic() - started, code))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: all("vllm-0" in pods for pods in exclusions_by_picker(gray_stack)),
                   within=60, what="every picker leaving the gray pod out")
        # Read before counting answers: those answered while the pages are read (a second on
        # a loaded machine) were routed before it.
        before = routed_by_pod(gray_stack)
        noticed_after = len(results)
        wait_until(lambda: len(results) >= noticed_after + judged, within=120,
                   what=f"{judged} more requests answered")
        after = routed_by_pod(gray_stack)
    finally:
        stop.set()
        for thread in threads:
            thread.join(20)
    routed = after - before
    total = sum(routed.values())
    print(f"gray pod's share of the {total} requests after every picker left it out: "
          f"{routed['vllm-0']} ({routed['vllm-0'] / max(total, 1):.2%}); before: {dict(before)}; "
          f"slowest request {max(elapsed for _, elapsed, _ in results):.2f}s; "
          f"errors {Counter(code for _, _, code in results if code)}")
    # Those answered were routed in the window, but for the few in flight at its start.
    assert total >= judged - clients, routed
    # Left out for a cool-off (5 s, doubling after a failed probe), then one probe at a time:
    # a handful of requests per picker however long the window takes.
    assert routed["vllm-0"] / total < 0.02, routed
    assert exclusions(gray_stack) == {"vllm-0"}  # and no healthy pod
    # Nothing hangs past the response timeout (3 s); the gray pod's few answers are errors.
    assert max(elapsed for _, elapsed, _ in results) < 3.0 + 1.5
    assert {(status, code) for status, _, code in results} <= {
        (200, ""), (500, "500"), (504, "upstream_timeout")}  # vLLM: code 500


def python_lines(action: Callable[[], None]) -> int:
    """Lines of Python ``action`` runs, in it and in everything it calls (``sys.settrace``)."""
    lines = 0

    def local(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal lines
        if event == "line":
            lines += 1
        return local

    sys.settrace(lambda frame, event, arg: local)
    try:
        action()
    finally:
        sys.settrace(None)
    return lines


def test_the_in_flight_check_costs_the_same_with_thousands_of_old_requests() -> None:
    """Every decision runs this check: with long streams a pod has thousands of requests older
    than gray_after, and counting them one by one made a decision cost grow with them (found by
    ``lig bench`` running the real core at 270 req/s). The work is counted in lines of Python
    run, not timed: a ratio of wall-clock times, even minimums of repeats, is at the mercy of a
    loaded machine."""

    def cost(in_flight: int) -> int:
        guard = GrayPods(gray_after=2.0, sample_every=0)
        for index in range(in_flight):
            guard.started("a", index * 1e-4)
        views = [PodView("a", "10.0.0.1:8000", running=in_flight), IDLE["b"]]
        now = in_flight * 1e-4 + 10.0

        def decide() -> None:
            for _ in range(200):
                assert guard.excluded(views, now) == set()

        return python_lines(decide)

    # One by one, 100 times the requests would be about 100 times the lines.
    assert cost(20_000) < 2 * cost(200)
