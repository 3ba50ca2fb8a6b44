"""``lig up`` routes by exact cache contents out of the box: its pickers get
``--tokenizer <pool>=builtin:lig-sim`` for the pool it simulates, so a prefix warmed on one pod
directly (bypassing the gateway: no picker routed it, only the pod's KV events tell where it is
cached) draws every following request with that prefix through Envoy to that pod, for each pod.
Without the tokenizer the pickers keep the approximate index, which cannot know."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lig.topology import BASE_MODEL
from tests.support.lig_up import STATUS_STALE_AFTER, RunningStack, lig_up
from tests.support.waiting import wait_until
from tests.test_precise_routing_e2e import PREFIX_WORDS, QUESTIONS, chat, prefix

pytestmark = pytest.mark.timeout(150)

POOL = "vllm-llama3-8b-instruct"
PODS = 3
SIM_ROW = re.compile(r"^\s*sim\s+(\d+) pods of (\S+) on :(\d+)-(\d+)")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    state_dir = tmp_path_factory.mktemp("lig-up-precise") / "state"
    with lig_up(state_dir, "--pods", str(PODS), "--pickers", "1",
                "--sim-args", "--time-scale 50", ready_within=60) as running:
        yield running


def pod_urls(stack: RunningStack) -> list[str]:
    """The simulated pods' URLs, from the summary's ``sim`` row (pod i on the i-th port)."""
    [match] = [m for m in map(SIM_ROW.match, stack.lines) if m]
    count, pool, first, last = match.groups()
    assert (int(count), pool) == (PODS, POOL) and int(last) - int(first) == PODS - 1
    return [f"http://127.0.0.1:{port}" for port in range(int(first), int(last) + 1)]


def served(url: str) -> float:
    """Requests the pod completed (``vllm:request_success_total``, every reason)."""
    text = httpx.get(url + "/metrics", timeout=5.0).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def precise(stack: RunningStack, name: str) -> float:
    """The picker's ``lig_picker_precise_<name>`` sample of the pool (0 if absent)."""
    [url] = stack.info.picker_metrics
    for family in text_string_to_metric_families(httpx.get(url, timeout=5.0).text):
        for sample in family.samples:
            if sample.name == f"lig_picker_precise_{name}" and sample.labels.get("pool") == POOL:
                return sample.value
    return 0.0


def idle_since(stack: RunningStack, index: int, since: float) -> bool:
    """Whether the latest snapshot of pod ``index`` (``lig status``) was scraped after
    ``since`` (wall clock) and shows it idle."""
    result = subprocess.run(
        [sys.executable, "-m", "lig.cli", "status", "--state-dir", str(stack.state_dir),
         *STATUS_STALE_AFTER, "--json"], capture_output=True, text=True, timeout=30)
    pods = {pod["pod"]: pod for pod in json.loads(result.stdout)["pods"]}
    pod = pods.get(f"vllm-{index}")
    return pod is not None and pod["age_s"] is not None \
        and time.time() - pod["age_s"] > since and not pod["waiting"] and not pod["running"]


def test_a_prefix_warmed_on_a_pod_draws_its_requests_there(stack: RunningStack) -> None:
    urls = pod_urls(stack)
    picker_row = next(line for line in stack.lines if line.lstrip().startswith("picker-0 "))
    assert f"tokenizer {POOL}=builtin:lig-sim" in picker_row, picker_row
    with httpx.Client(base_url=stack.gateway, timeout=30.0) as gateway:
        for group, url in enumerate(urls):
            system = prefix(group)
            stored = precise(stack, "blocks_stored_total")
            warm = httpx.post(url + "/v1/chat/completions", timeout=30.0,
                              json=chat(BASE_MODEL, system, "warm up"))
            assert warm.status_code == 200, warm.text
            warmed = time.time()
            # Until the pod's events reach the picker a request may go elsewhere: wait until
            # its precise index took the prefix's blocks.
            wait_until(lambda stored=stored: precise(stack, "blocks_stored_total")
                       >= stored + PREFIX_WORDS // 16,
                       within=20, what=f"the blocks of pod {group} in the picker's index")
            # And until the pickers' view of the pod was scraped after the warm-up: a snapshot
            # taken during it shows a busy pod (the test stacks scrape every 1.25 s), which the
            # policy's queue filter may pass over.
            wait_until(lambda group=group, warmed=warmed: idle_since(stack, group, warmed),
                       within=20, what=f"a snapshot of pod {group} after its warm-up")
            before = [served(u) for u in urls]
            for question in range(QUESTIONS):
                response = gateway.post("/v1/chat/completions", json=chat(
                    BASE_MODEL, system, f"question {question} of group {group}?"))
                assert response.status_code == 200, response.text
            moved = [served(u) - b for u, b in zip(urls, before, strict=True)]
            assert moved[group] == QUESTIONS, (group, moved)
    # Every pod's events reached the precise index (each was warmed directly).
    assert precise(stack, "event_pods") == PODS
