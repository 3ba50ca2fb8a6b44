"""Issue 14's user path on the real stack: ``lig up`` (two pickers behind Envoy, simulated pods)
serves mixed traffic through Envoy (a shared prompt prefix, streamed answers, three
criticalities), each response's ``x-request-id`` is kept, ``lig record --since`` exports the
window, and the real CLI, in subprocesses, reads the file:

- ``lig replay --what-if --policies recorded --json`` reproduces every recorded pick;
- ``lig explain --recording --request-id`` shows each quoted request's pick, equal to the pod
  whose own ``vllm:request_success_total`` counted it, and the re-run agrees;
- ``lig bench --trace-from-recording`` plays one arrival per recorded decision.

One stack and one recording serve every test of the module."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest
from nats.aio.client import Client

from recording.fileformat import read_header
from recording.records import ReadCounts, Registry, read_records
from scheduling_bench.results import RunMetrics
from shared.schemas import EndpointSet, decode
from shared.subjects import Subjects, endpoints_key
from tests.support.lig_up import lig_up
from tests.test_recording_e2e import lig, metric

pytestmark = pytest.mark.timeout(300)

BASE = "meta-llama/Llama-3.1-8B-Instruct"
# Three of the picker's 1 KiB prefix blocks: the later requests sharing it hit the prefix index.
SHARED_PREFIX = "You are a careful assistant. Answer in one short sentence. " * 55
# (model, streamed, shares the prefix, objective header): sent one at a time, so each pod's
# success counter names the pod that served it. Criticalities: Critical (the base), Sheddable
# (sql-lora, or the base naming it as its objective), Standard (tweet-summary).
SEQUENTIAL = [(BASE, False, True, None), (BASE, True, True, None), (BASE, False, False, None),
              ("sql-lora", False, False, None), (BASE, True, True, None),
              ("tweet-summary", True, False, None), (BASE, False, True, "sql-lora"),
              ("sql-lora", True, True, None), (BASE, False, True, None),
              ("tweet-summary", False, True, None), (BASE, True, False, "tweet-summary"),
              (BASE, False, True, None)]
CRITICALITY = {BASE: "Critical", "sql-lora": "Sheddable", "tweet-summary": "Standard"}
CONCURRENT = 8  # then a burst of shared-prefix requests at once, half streamed


@dataclass
class Sent:
    """A request sent through Envoy: its id from the response header and, when it was sent
    alone, the address of the pod whose success counter it raised."""

    request_id: str
    model: str
    streamed: bool
    criticality: str
    served: str | None


@dataclass
class Recorded:
    """The recording of the traffic and what the client saw."""

    path: Path
    pods: dict[str, str]  # name: ip:port
    sent: list[Sent]


async def pod_addresses(nats_url: str, prefix: str, pool: str) -> dict[str, str]:
    """The pool's endpoints (name: ``ip:port``) as the registry published them."""
    client = Client()
    await client.connect(nats_url)
    try:
        bucket = await client.jetstream().key_value(Subjects(prefix).registry_bucket)
        entry = await bucket.get(endpoints_key(pool))
    finally:
        await client.close()
    assert entry.value is not None
    return {e.name: f"{e.address}:{e.port}" for e in decode(entry.value, EndpointSet).endpoints}


async def successes(client: httpx.AsyncClient, addresses: list[str]) -> dict[str, float]:
    """Each simulated pod's ``vllm:request_success_total``, read from the pod itself."""
    pages = await asyncio.gather(*(client.get(f"http://{a}/metrics") for a in addresses))
    return {address: metric(page.text, "vllm:request_success_total")
            for address, page in zip(addresses, pages, strict=True)}


async def send(client: httpx.AsyncClient, gateway: str, model: str, prompt: str,
               streamed: bool, objective: str | None = None) -> str:
    """One completion through Envoy, read to the end; the ``x-request-id`` it came back with."""
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "stream": streamed}
    headers = {"x-gateway-inference-objective": objective} if objective else {}
    async with client.stream("POST", f"{gateway}/v1/completions", json=body,
                             headers=headers) as response:
        text = (await response.aread()).decode()
        assert response.status_code == 200, text
        if streamed:
            assert text.rstrip().endswith("data: [DONE]"), text
        request_id = response.headers.get("x-request-id", "")
    assert request_id, "Envoy returned no x-request-id"
    return request_id


async def traffic(gateway: str, addresses: list[str]) -> list[Sent]:
    """The sequential requests (each attributed to a pod by the pods' counters), then a burst."""
    sent: list[Sent] = []
    async with httpx.AsyncClient(timeout=30) as client:
        before = await successes(client, addresses)
        for i, (model, streamed, shared, objective) in enumerate(SEQUENTIAL):
            prompt = (SHARED_PREFIX if shared else "") + f"question {i}"
            request_id = await send(client, gateway, model, prompt, streamed, objective)
            after = await successes(client, addresses)
            raised = [a for a in addresses if after[a] > before[a]]
            assert len(raised) == 1 and sum(after.values()) == sum(before.values()) + 1, \
                (before, after)
            sent.append(Sent(request_id, model, streamed, CRITICALITY[objective or model],
                             raised[0]))
            before = after
        ids = await asyncio.gather(*(
            send(client, gateway, BASE, SHARED_PREFIX + f"burst {i}", i % 2 == 0)
            for i in range(CONCURRENT)))
        sent += [Sent(request_id, BASE, i % 2 == 0, CRITICALITY[BASE], None)
                 for i, request_id in enumerate(ids)]
    return sent


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorded]:
    """Run ``lig up``, send the traffic, export the window covering all of it."""
    work = tmp_path_factory.mktemp("recording-cli")
    out = work / "fleet.ligrec"
    with lig_up(work / "state", "--pods", "3", "--pickers", "2") as stack:
        info = stack.info
        started = time.monotonic()
        pods = asyncio.run(pod_addresses(info.nats_url, info.prefix, info.pool))
        sent = asyncio.run(traffic(stack.gateway, list(pods.values())))
        # The pickers' record batches reach the recording a moment after the last response:
        # exported again until every request's decision and outcome are in the file.
        deadline = time.monotonic() + 20
        while True:
            # The window starts before the first request (whole seconds, rounded up, margin).
            since = int(time.monotonic() - started) + 5
            exported = lig("record", "--out", str(out), "--since", f"{since}s",
                           "--nats-url", info.nats_url, "--prefix", info.prefix)
            assert exported.returncode == 0, exported.stdout + exported.stderr
            missing = unrecorded(out, sent)
            if not missing:
                break
            assert time.monotonic() < deadline, f"records missing after 20 s: {missing}"
            time.sleep(0.2)
    yield Recorded(out, pods, sent)


def unrecorded(path: Path, sent: list[Sent]) -> list[str]:
    """The requests of ``sent`` whose decision or outcome record ``path`` lacks."""
    with path.open("rb") as source:
        read_header(source)
        found = Counter((recorded.record.request_id, type(recorded.record).__name__)
                        for recorded in read_records(source, Registry(), ReadCounts()))
    return [f"{request.request_id} {kind}" for request in sent
            for kind in ("DecisionRecord", "OutcomeRecord")
            if not found[request.request_id, kind]]


def test_what_if_with_the_recorded_policy_reproduces_every_recorded_pick(
        recorded: Recorded) -> None:
    result = lig("replay", str(recorded.path), "--what-if", "--policies", "recorded", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["undecodable"] == 0, report
    assert report["decisions"] == len(recorded.sent), report
    (policy,) = report["policies"]
    assert policy["agree"] == report["decisions"] and policy["agreement"] == 1.0, policy


def test_explain_shows_the_pick_of_a_quoted_request_and_the_pod_that_served_it(
        recorded: Recorded) -> None:
    attributed = [sent for sent in recorded.sent if sent.served is not None]
    assert {sent.streamed for sent in attributed} == {True, False}
    assert {sent.criticality for sent in attributed} == set(CRITICALITY.values())
    for sent in attributed:
        result = lig("explain", "--recording", str(recorded.path), "--request-id",
                     sent.request_id, "--json")
        assert result.returncode == 0, result.stdout + result.stderr
        shown = json.loads(result.stdout)
        (decision,) = shown["decisions"]
        assert decision["agrees"] is True, decision
        assert decision["recorded_shed"] is False, decision
        assert decision["explain"]["pick"] == decision["recorded_pick"], decision
        assert decision["explain"]["request"]["model"] == sent.model, decision
        assert decision["explain"]["request"]["criticality"] == sent.criticality, decision
        assert recorded.pods[decision["recorded_pick"]] == sent.served, (decision, sent)
        outcome = decision["outcome"]
        # The shipped Envoy shows the picker only the responses its gray-pod guard samples: the
        # others' status is 0 (docs/recording.md, outcome records).
        assert outcome is not None and outcome["status"] in (0, 200), decision
        assert outcome["served"] == decision["recorded_pick"], decision
    # The text form says the same for one of them.
    text = lig("explain", "--recording", str(recorded.path), "--request-id",
               attributed[0].request_id)
    assert text.returncode == 0, text.stdout + text.stderr
    assert "the re-run agrees" in text.stdout, text.stdout


def test_bench_plays_one_arrival_per_recorded_decision(recorded: Recorded,
                                                      tmp_path: Path) -> None:
    out = tmp_path / "bench"
    result = lig("bench", "--trace-from-recording", str(recorded.path), "--policies", "default",
                 "--jobs", "1", "--no-plots", "--out", str(out), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    (run,) = msgspec.json.decode((out / "results.json").read_bytes(), type=list[RunMetrics])
    assert run.workload == "recording"
    assert run.requests == run.completed == len(recorded.sent), run
    assert f"{len(recorded.sent)} arrivals over" in result.stdout, result.stdout
    hits = re.search(rf"(\d+) of {len(recorded.sent)} recorded decisions had prefix-cache hits",
                     result.stdout)
    assert hits is not None and int(hits.group(1)) > 0, result.stdout
