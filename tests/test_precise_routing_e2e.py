"""Precise prefix routing end to end (issue 16): real nats-server, ``lig sim`` pods publishing
KV-cache events over ZMQ on loopback (both encodings in one pool), ``lig collector``,
``lig kv-events``, ``lig picker --tokenizer pool-a=builtin:lig-sim`` and a real Envoy.

A pod is warmed with a long prefix directly, bypassing the gateway: no picker routed it, so only
the pod's own events can tell where that prefix is cached. Requests sharing the prefix then go
through Envoy to exactly that pod, for each pod of the pool. A pool the picker has no tokenizer
for still routes, on the approximate index.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import nats
import pytest

from shared.schemas import InferenceModel, InferencePool, encode
from shared.subjects import model_key
from simulator.tokenizer import WORDS
from tests.support.collector import collector_process, pod, put_pool
from tests.support.envoy import EnvoyProcess, start_envoy
from tests.support.picker import PickerProcess
from tests.support.simulator import SimulatedPods
from tests.support.waiting import wait_until
from tests.test_kv_events_e2e import kv_events_process

pytestmark = pytest.mark.process  # real NATS, Envoy, picker, collector, kv-events and sims

# Every pod publishes its events at its serving port + EVENTS_OFFSET (replay + REPLAY_OFFSET):
# one fleet-wide offset, as lig kv-events takes it, across several lig sim processes.
EVENTS_OFFSET = 1000
REPLAY_OFFSET = 2000
PREFIX_WORDS = 1200  # about 1,200 tokens of lig sim's tokenizer: 75 blocks of 16
QUESTIONS = 4


def event_args(encoding: str) -> Any:
    """``lig sim`` flags publishing KV events at the fixed offsets from its first pod's port."""
    def args(base: int) -> list[str]:
        config = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{base + EVENTS_OFFSET}",
                  "replay_endpoint": f"tcp://*:{base + REPLAY_OFFSET}", "topic": "kv"}
        return ["--kv-events-config", msgspec.json.encode(config).decode(),
                "--kv-events-encoding", encoding]
    return args


def served_count(pods: SimulatedPods, index: int) -> float:
    """Requests pod ``index`` completed (``vllm:request_success_total``, every reason)."""
    text = httpx.get(pods.url(index) + "/metrics", timeout=5.0).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def prefix(seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(PREFIX_WORDS))


def chat(model: str, system: str, question: str) -> dict[str, Any]:
    return {"model": model, "max_tokens": 4, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}]}


class Fleet:
    """The running stack: pool-a (two pods per encoding, with a tokenizer), pool-b (two pods,
    without), and the gateway's URL."""

    def __init__(self, pools: dict[str, list[tuple[str, SimulatedPods, int]]], envoy: EnvoyProcess,
                 picker: PickerProcess) -> None:
        self.pools = pools
        self.envoy = envoy
        self.picker = picker
        self.client = httpx.Client(base_url=envoy.url, timeout=30.0)

    def stored(self, pool: str) -> float:
        """Blocks the picker's precise index of ``pool`` has taken from the pods' events."""
        name = f'lig_picker_precise_blocks_stored_total{{pool="{pool}"}} '
        return sum(float(line.rsplit(" ", 1)[1]) for line in self.picker.metrics().splitlines()
                   if line.startswith(name))

    def counts(self, pool: str) -> dict[str, float]:
        return {name: served_count(pods, index) for name, pods, index in self.pools[pool]}


async def _register(nats_url: str, pools: dict[str, list[tuple[str, SimulatedPods, int]]]
                    ) -> None:
    nc = await nats.connect(nats_url)
    try:
        kv = await nc.jetstream().create_key_value(bucket="lig-registry", history=5)
        for pool, members in pools.items():
            target = members[0][1].ports[members[0][2]]
            await put_pool(kv, InferencePool(name=pool, target_port=target),
                           [pod(name, pods.ports[index]) for name, pods, index in members])
            model = f"sim-{pool[-1]}"
            await kv.put(model_key(pool, model), encode(InferenceModel(model, pool)))
    finally:
        await nc.close()


@pytest.fixture
def fleet(nats_server: Any, tmp_path: Path) -> Iterator[Fleet]:
    with contextlib.ExitStack() as stack:
        sims = {
            "a-map": SimulatedPods(2, model="sim-a", time_scale=50.0, port_args=event_args("map")),
            "a-array": SimulatedPods(2, model="sim-a", time_scale=50.0, seed=1,
                                     port_args=event_args("array")),
            "b": SimulatedPods(2, model="sim-b", time_scale=50.0, seed=2,
                               port_args=event_args("map")),
        }
        for pods in sims.values():
            stack.enter_context(pods.start())
        pools = {
            "pool-a": [(f"{group}-{i}", sims[group], i) for group in ("a-map", "a-array")
                       for i in range(2)],
            "pool-b": [(f"b-{i}", sims["b"], i) for i in range(2)],
        }
        asyncio.run(_register(nats_server.url, pools))
        stack.enter_context(collector_process(nats_server.url, "c1", "--interval", "0.05",
                                              log_path=tmp_path / "collector.log"))
        stack.enter_context(kv_events_process(
            nats_server.url, None, events_port=f"+{EVENTS_OFFSET}",
            replay_port=f"+{REPLAY_OFFSET}"))
        picker = PickerProcess("pool-a", nats_server.url, tmp_path, extra_args=(
            "--pool", "pool-b", "--tokenizer", "pool-a=builtin:lig-sim", "--seed", "7"))
        picker.start()
        stack.callback(picker.stop)
        picker.wait_ready(timeout=30)
        envoy = start_envoy([picker.endpoint], tmp_path)
        stack.callback(envoy.stop)
        fleet = Fleet(pools, envoy, picker)
        stack.callback(fleet.client.close)
        yield fleet


def _ask(fleet: Fleet, body: dict[str, Any]) -> None:
    response = fleet.client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


def test_requests_go_to_the_pod_whose_events_show_their_prefix(fleet: Fleet) -> None:
    """For every pod of pool-a (both encodings): warm it directly, then every request with that
    prefix goes through Envoy to it. Chance would put 4 groups x 4 requests on the warmed pods
    with probability (1/4)^4 at best (the approximate index learns only from routed requests)."""
    for group, (name, pods, index) in enumerate(fleet.pools["pool-a"]):
        system = prefix(group)
        stored = fleet.stored("pool-a")
        warm = httpx.post(pods.url(index) + "/v1/chat/completions", timeout=30.0,
                          json=chat("sim-a", system, "warm up"))
        assert warm.status_code == 200, warm.text
        # Until the pod's events reach the picker a request may go elsewhere (and be learned
        # there by the approximate index): wait until its index took the prefix's blocks.
        wait_until(lambda stored=stored: fleet.stored("pool-a") >= stored + PREFIX_WORDS // 16,
                   within=15, what=f"the blocks of {name} in the picker's index")
        before = fleet.counts("pool-a")
        for question in range(QUESTIONS):
            _ask(fleet, chat("sim-a", system, f"question {question} of group {group}?"))
        after = fleet.counts("pool-a")
        moved = {pod_name: after[pod_name] - before[pod_name] for pod_name in after}
        assert moved[name] == QUESTIONS, (name, moved, fleet.picker.log()[-3000:])


def test_a_pool_without_tokenizer_still_routes(fleet: Fleet) -> None:
    _, pods, index = fleet.pools["pool-b"][1]
    system = prefix(100)
    httpx.post(pods.url(index) + "/v1/chat/completions", timeout=30.0,
               json=chat("sim-b", system, "warm up")).raise_for_status()
    before = fleet.counts("pool-b")
    for question in range(QUESTIONS):
        _ask(fleet, chat("sim-b", system, f"question {question}?"))
    after = fleet.counts("pool-b")
    assert sum(after.values()) - sum(before.values()) == QUESTIONS
    log = fleet.picker.log()
    assert "pool pool-b: pods publish KV events but the pool has no tokenizer" in log
    assert "pool pool-a: pods publish KV events but the pool has no tokenizer" not in log


