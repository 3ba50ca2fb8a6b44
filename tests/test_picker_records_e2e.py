"""The flight recorder with real processes: a request through a real Envoy to `lig sim` pods,
routed by a real picker over a real nats-server. The client gets Envoy's ``x-request-id`` back;
the picker's RecordBatch on ``lig.records.<pool>`` holds a DecisionRecord with that id and the
pod that served it, then its OutcomeRecord (status 200 and usage with ``--record-responses``;
with pods that report cached tokens, those and the prefix index's prediction, which the picker's
reuse counters add up)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from prometheus_client.parser import text_string_to_metric_families

from scheduling.record import DecisionRecord, OutcomeRecord, RecordBatch
from shared.schemas import decode
from shared.subjects import Subjects
from tests.support.envoy import EnvoyProcess, start_envoy
from tests.support.fleet_feed import FleetFeed
from tests.support.nats_server import NatsServer
from tests.support.nats_sync import subscribed
from tests.support.picker import PickerProcess
from tests.support.simulator import SimulatedPods

POOL = "pool-1"
MODEL = "sim-model"
ALIAS = "alias"  # rewritten to MODEL: its response passes the response-rewrite filter too
IDLE = {"waiting": 0, "running": 0, "kv_cache_usage": 0.05}


class Stack:
    """NATS, two simulated pods (registry and snapshots from a feed), one picker, one Envoy."""

    def __init__(self, workdir: Path, nats: NatsServer, picker_args: tuple[str, ...],
                 sim_args: tuple[str, ...] = ()) -> None:
        self.pods = SimulatedPods(2, time_scale=10.0, extra_args=sim_args).start()
        self.feed = FleetFeed(nats.url, POOL, interval=0.1).start()
        self.feed.set_pool()
        self.feed.set_model(MODEL)
        self.feed.set_model(ALIAS, target_models=[{"name": MODEL, "weight": 1}])
        self.names = {f"pod-{i}": self.pods.address(i) for i in range(2)}
        self.feed.set_endpoints(self.names)
        self.feed.set_many({name: (address, dict(IDLE)) for name, address in self.names.items()})
        self.picker = PickerProcess(POOL, nats.url, workdir, extra_args=picker_args).start()
        self.picker.wait_ready()
        self.envoy: EnvoyProcess = start_envoy([self.picker.endpoint], workdir)

    def close(self) -> None:
        self.envoy.stop()
        self.picker.stop()
        self.feed.stop()
        self.pods.stop()


@pytest.fixture
def stack(request: pytest.FixtureRequest, tmp_path: Path,
          nats_server: NatsServer) -> Iterator[Stack]:
    built = Stack(tmp_path, nats_server, tuple(request.param))
    try:
        yield built
    finally:
        built.close()


@pytest.fixture
def reporting_stack(tmp_path: Path, nats_server: NatsServer) -> Iterator[Stack]:
    """Pods that report cached tokens (as vLLM with --enable-prompt-tokens-details), a picker
    that reads every response."""
    built = Stack(tmp_path, nats_server, ("--record-responses",),
                  ("--enable-prompt-tokens-details",))
    try:
        yield built
    finally:
        built.close()


class Records:
    """Every record published on the pool's subject, by kind and request id."""

    def __init__(self) -> None:
        self.decisions: dict[str, DecisionRecord] = {}
        self.outcomes: dict[str, OutcomeRecord] = {}
        self.pickers: set[str] = set()

    async def on_message(self, message: Msg) -> None:
        batch = decode(message.data, RecordBatch)
        self.pickers.add(batch.picker)
        assert batch.pool == POOL
        for record in batch.records:
            if isinstance(record, DecisionRecord):
                self.decisions[record.request_id] = record
            else:
                self.outcomes[record.request_id] = record

    async def wait_for(self, request_id: str, within: float = 5.0
                       ) -> tuple[DecisionRecord, OutcomeRecord]:
        deadline = time.monotonic() + within
        while request_id not in self.outcomes:
            assert time.monotonic() < deadline, f"no outcome record for {request_id}"
            await asyncio.sleep(0.01)
        return self.decisions[request_id], self.outcomes[request_id]


async def subscribe(nc: Client) -> Records:
    records = Records()
    await subscribed(nc, Subjects().records(POOL), cb=records.on_message)
    return records


@pytest.mark.parametrize("stack", [("--record-responses",)], indirect=True)
async def test_the_client_gets_the_request_id_and_the_records_carry_it(
        stack: Stack, nc: Client) -> None:
    records = await subscribe(nc)
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 5}
    async with httpx.AsyncClient(base_url=stack.envoy.url, timeout=10) as client:
        response = await client.post("/v1/completions", json=body)
        own = await client.post("/v1/completions", json=body,
                                headers={"x-request-id": "my-own-id-42"})
        streamed = await client.post("/v1/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}})
        aliased = await client.post("/v1/completions", json={**body, "model": ALIAS})
    assert response.status_code == own.status_code == streamed.status_code == 200
    assert aliased.status_code == 200 and aliased.json()["model"] == ALIAS
    request_id = response.headers["x-request-id"]
    assert len(request_id) >= 32  # Envoy generated one (a UUID)
    assert own.headers["x-request-id"] == "my-own-id-42"  # a client's id is kept
    usage = response.json()["usage"]
    decision, outcome = await records.wait_for(request_id)
    assert decision.model == decision.target_model == MODEL and decision.max_tokens == 5
    assert decision.pick in stack.names and not decision.shed
    assert sorted(view.name for view in decision.view) == sorted(stack.names)
    assert (outcome.seq, outcome.served, outcome.status) == (decision.seq, decision.pick, 200)
    assert (outcome.prompt_tokens, outcome.completion_tokens) == (
        usage["prompt_tokens"], usage["completion_tokens"])
    assert outcome.ttfb_ms is not None and 0 < outcome.ttfb_ms <= outcome.duration_ms
    decision, outcome = await records.wait_for("my-own-id-42")
    assert outcome.status == 200 and outcome.served == decision.pick
    stream_id = streamed.headers["x-request-id"]
    chunks = [json.loads(line[5:]) for line in streamed.text.splitlines()
              if line.startswith("data:") and line.strip() != "data: [DONE]"]
    streamed_usage = next(chunk["usage"] for chunk in chunks if chunk.get("usage"))
    decision, outcome = await records.wait_for(stream_id)
    assert outcome.status == 200 and outcome.ttfb_ms is not None
    assert outcome.completion_tokens == streamed_usage["completion_tokens"]
    decision, outcome = await records.wait_for(aliased.headers["x-request-id"])
    assert (decision.model, decision.target_model, outcome.status) == (ALIAS, MODEL, 200)
    assert outcome.completion_tokens == aliased.json()["usage"]["completion_tokens"]
    assert len(records.pickers) == 1


@pytest.mark.parametrize("stack", [()], indirect=True)
async def test_by_default_every_decision_and_its_end_are_recorded(
        stack: Stack, nc: Client) -> None:
    records = await subscribe(nc)
    async with httpx.AsyncClient(base_url=stack.envoy.url, timeout=10) as client:
        ids = []
        for _ in range(8):
            response = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": "hi", "max_tokens": 3})
            assert response.status_code == 200
            ids.append(response.headers["x-request-id"])
        refused = await client.post("/v1/completions", content=b"{not json")
    # The picker's own answers carry the id too (nothing is recorded for a 400).
    assert refused.status_code == 400 and refused.headers["x-request-id"]
    for request_id in ids:
        decision, outcome = await records.wait_for(request_id)
        assert outcome.served == decision.pick and outcome.duration_ms > 0
        # Without --record-responses the status is known only for the responses the gray-pod
        # guard sampled (one in four by default).
        assert outcome.status in (0, 200)
    assert len({records.decisions[request_id].seq for request_id in ids}) == 8


def reuse_counters(picker: PickerProcess) -> dict[str, float]:
    """The pool's ``lig_picker_reused_tokens_*_total`` counters by kind (0 when absent)."""
    found = {"predicted": 0.0, "observed": 0.0, "reports": 0.0}
    for family in text_string_to_metric_families(picker.metrics()):
        for sample in family.samples:
            kind = sample.name.removeprefix("lig_picker_reused_tokens_").removesuffix("_total")
            if sample.name.endswith("_total") and kind in found and sample.labels == {
                    "pool": POOL}:
                found[kind] = sample.value
    return found


async def test_the_outcomes_and_counters_hold_the_cache_hits_the_pods_report(
        reporting_stack: Stack, nc: Client) -> None:
    """The same long prompt three times, one at a time (the second streamed): with two pods
    at least one request lands where the prompt was served before, and that pod reports a
    prefix-cache hit that the picker's prefix index predicted too."""
    stack = reporting_stack
    records = await subscribe(nc)
    prompt = "You are a helpful assistant. Answer in one line. " * 100  # ~4.9 KiB: 4 blocks
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3}
    ids = []
    async with httpx.AsyncClient(base_url=stack.envoy.url, timeout=10) as client:
        for stream in (False, True, False):
            extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
            response = await client.post("/v1/completions", json={**body, **extra})
            assert response.status_code == 200
            ids.append(response.headers["x-request-id"])
            await records.wait_for(ids[-1])  # ended before the next is sent
    outcomes = [(await records.wait_for(request_id))[1] for request_id in ids]
    assert all(o.cached_tokens is not None and o.predicted_cached_tokens is not None
               for o in outcomes)
    assert outcomes[0].cached_tokens == outcomes[0].predicted_cached_tokens == 0
    seen: set[str] = set()
    again = 0
    for outcome in outcomes:
        if outcome.served in seen:  # served the prompt before: a hit, and foreseen
            again += 1
            assert outcome.cached_tokens and outcome.cached_tokens < outcome.prompt_tokens
            assert outcome.predicted_cached_tokens
        seen.add(outcome.served)
    assert again >= 1
    assert reuse_counters(stack.picker) == {
        "predicted": sum(o.predicted_cached_tokens or 0 for o in outcomes),
        "observed": sum(o.cached_tokens or 0 for o in outcomes),
        "reports": 3}
