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
from tests.support.hf_tokenizer import write_tokenizer
from tests.support.picker import PickerProcess
from tests.support.simulator import SimulatedPods
from tests.support.waiting import wait_until
from tests.test_kv_events_e2e import kv_events_process

pytestmark = pytest.mark.process  # real NATS, Envoy, picker, collector, kv-events and sims

# Every pod publishes its events at its serving port + EVENTS_OFFSET (replay + REPLAY_OFFSET):
# one fleet-wide offset, as lig kv-events takes it, across several lig sim processes of up to
# EVENTS_OFFSET pods, each leasing PORT_SPAN ports from its first pod's.
EVENTS_OFFSET = 4
REPLAY_OFFSET = 8
PORT_SPAN = 12
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


@contextlib.contextmanager
def running_fleet(nats_url: str, workdir: Path, sims: dict[str, SimulatedPods],
                  pools: dict[str, list[tuple[str, str, int]]], picker_args: tuple[str, ...]
                  ) -> Iterator[Fleet]:
    """``sims`` started, ``pools`` (pool -> (pod name, sim group, index)) registered, then the
    collector, lig kv-events, one picker (``picker_args``) and Envoy."""
    with contextlib.ExitStack() as stack:
        for pods in sims.values():
            stack.enter_context(pods)  # starts them (a start() before it started them twice)
        members = {pool: [(name, sims[group], index) for name, group, index in listed]
                   for pool, listed in pools.items()}
        asyncio.run(_register(nats_url, members))
        # Scraped every 0.5 s (timeout 0.4 s): at 0.05 s, the 40 ms timeout failed every scrape
        # of the loaded pods now and then, and a pod whose scrape failed is not fresh.
        stack.enter_context(collector_process(nats_url, "c1", "--interval", "0.5",
                                              log_path=workdir / "collector.log"))
        stack.enter_context(kv_events_process(
            nats_url, None, events_port=f"+{EVENTS_OFFSET}", replay_port=f"+{REPLAY_OFFSET}"))
        served = [arg for pool in pools for arg in ("--pool", pool)]
        # Snapshots count as fresh for 5 s: on a loaded machine the collector's may lag, and
        # with none fresh the picker picks at random (not what this test is about).
        picker = PickerProcess(served[1], nats_url, workdir, stale_after=5.0,
                               extra_args=(*served[2:], "--seed", "7", *picker_args))
        picker.start()
        stack.callback(picker.stop)
        picker.wait_ready(timeout=30)
        envoy = start_envoy([picker.endpoint], workdir)
        stack.callback(envoy.stop)
        fleet = Fleet(members, envoy, picker)
        stack.callback(fleet.client.close)
        yield fleet


@pytest.fixture
def fleet(nats_server: Any, tmp_path: Path) -> Iterator[Fleet]:
    sims = {
        "a-map": SimulatedPods(2, model="sim-a", time_scale=50.0, port_args=event_args("map"),
                               port_span=PORT_SPAN),
        "a-array": SimulatedPods(2, model="sim-a", time_scale=50.0, seed=1,
                                 port_args=event_args("array"), port_span=PORT_SPAN),
        "b": SimulatedPods(2, model="sim-b", time_scale=50.0, seed=2,
                           port_args=event_args("map"), port_span=PORT_SPAN),
    }
    pools = {"pool-a": [(f"{group}-{i}", group, i) for group in ("a-map", "a-array")
                        for i in range(2)],
             "pool-b": [(f"b-{i}", "b", i) for i in range(2)]}
    with running_fleet(nats_server.url, tmp_path, sims, pools,
                       ("--tokenizer", "pool-a=builtin:lig-sim")) as running:
        yield running


def _ask(fleet: Fleet, body: dict[str, Any]) -> None:
    response = fleet.client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


def check_exact_routing(fleet: Fleet, pool: str, model: str, min_blocks: int) -> None:
    """For every pod of ``pool``: warm it directly with a new prefix (``min_blocks`` blocks at
    least), then every request with that prefix goes through Envoy to it."""
    for group, (name, pods, index) in enumerate(fleet.pools[pool]):
        system = prefix(group)
        stored = fleet.stored(pool)
        warm = httpx.post(pods.url(index) + "/v1/chat/completions", timeout=30.0,
                          json=chat(model, system, "warm up"))
        assert warm.status_code == 200, warm.text
        # Until the pod's events reach the picker a request may go elsewhere (and be learned
        # there by the approximate index): wait until its index took the prefix's blocks.
        wait_until(lambda stored=stored: fleet.stored(pool) >= stored + min_blocks,
                   within=15, what=f"the blocks of {name} in the picker's index")
        before = fleet.counts(pool)
        for question in range(QUESTIONS):
            _ask(fleet, chat(model, system, f"question {question} of group {group}?"))
        after = fleet.counts(pool)
        moved = {pod_name: after[pod_name] - before[pod_name] for pod_name in after}
        assert moved[name] == QUESTIONS, (name, moved, fleet.picker.log()[-3000:])


def test_requests_go_to_the_pod_whose_events_show_their_prefix(fleet: Fleet) -> None:
    """Every pod of pool-a (both encodings). Chance would put 4 groups x 4 requests on the
    warmed pods with probability (1/4)^4 at best (the approximate index learns only from
    routed requests)."""
    check_exact_routing(fleet, "pool-a", "sim-a", PREFIX_WORDS // 16)


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




def test_exact_routing_with_a_tokenizer_json(nats_server: Any, tmp_path: Path) -> None:
    """The Hugging Face path end to end: ``lig sim --tokenizer`` pods and ``lig picker
    --tokenizer`` read the same tokenizer.json (a byte-level BPE with a ChatML template)."""
    directory = write_tokenizer(tmp_path / "tokenizer").parent
    sims = {"h": SimulatedPods(3, model="sim-h", time_scale=50.0, port_args=event_args("map"),
                               port_span=PORT_SPAN, extra_args=("--tokenizer", str(directory)))}
    pools = {"pool-h": [(f"h-{i}", "h", i) for i in range(3)]}
    with running_fleet(nats_server.url, tmp_path, sims, pools,
                       ("--tokenizer", f"pool-h={directory}")) as running:
        # The trained BPE has a token per word or more: at least the words' count of tokens.
        check_exact_routing(running, "pool-h", "sim-h", PREFIX_WORDS // 16)
