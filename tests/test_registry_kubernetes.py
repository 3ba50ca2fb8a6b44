"""``lig registry --kubernetes`` as a real process against the test API server
(tests/support/kube_apiserver.py) and a real nats-server: pods, selectors, several ports,
relists (410 Gone, restarts), bad objects, and model entries equal to the YAML source's."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from nats.aio.client import Client
from nats.js.client import KV_PRE_TEMPLATE, KV_STREAM_TEMPLATE

from services.registry import kube_objects, kube_source
from services.registry.files import FileSnapshot, SourceFile, load
from services.registry.kube_objects import KubeState, criticality_of
from services.registry.publisher import desired_entries
from shared.schemas import Criticality, EndpointSet, InferenceModel, decode
from shared.subjects import Subjects
from tests.support.kube_apiserver import KubeApiServer, matches
from tests.support.ports import free_port
from tests.support.processes import die_with_parent
from tests.support.registry_yaml import dump
from tests.support.waiting import eventually
from tests.test_registry_service import LIG, bucket, poll_until

PROMISE = 1.0  # seconds from an API change to the KV bucket
STOP_S = 5.0  # a registry stops within a few seconds of SIGTERM
BUCKET = Subjects().registry_bucket
X = "inference.networking.x-k8s.io/v1alpha2"


def pod(name: str, ip: str | None = "10.1.0.1", ready: bool = True, **labels: str) -> dict:
    status: dict[str, Any] = {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"kind": "Pod", "metadata": {"name": name, "labels": labels or {"app": "a"}},
            "status": status}


def pool(name: str = "pool-a", ports: tuple[int, ...] = (8000,), labels: dict | None = None,
         annotations: dict | None = None) -> dict:
    meta: dict[str, Any] = {"name": name}
    if annotations:
        meta["annotations"] = annotations
    return {"kind": "InferencePool", "metadata": meta, "spec": {
        "selector": {"matchLabels": {"app": "a"} if labels is None else labels},
        "targetPorts": [{"number": p} for p in ports],
        "endpointPickerRef": {"name": "lig-picker", "port": {"number": 9002}}}}


def objective(name: str, priority: Any, pool_name: str = "pool-a") -> dict:
    spec: dict[str, Any] = {"poolRef": {"name": pool_name}}
    if priority is not None:
        spec["priority"] = priority
    return {"kind": "InferenceObjective", "metadata": {"name": name}, "spec": spec}


def rewrite(name: str, rules: list[tuple[list[str], list[tuple[str, int]]]],
            pool_name: str = "pool-a") -> dict:
    return {"kind": "InferenceModelRewrite", "metadata": {"name": name}, "spec": {
        "poolRef": {"group": "inference.networking.k8s.io", "name": pool_name},
        "rules": [{"matches": [{"model": {"type": "Exact", "value": m}} for m in models],
                   "targets": [{"modelRewrite": t, "weight": w} for t, w in targets]}
                  for models, targets in rules]}}


def endpoints(contents: dict[str, bytes], pool_name: str = "pool-a") -> list[str] | None:
    value = contents.get(f"endpoints.{pool_name}")
    if value is None:
        return None
    return [f"{e.name}@{e.hostport}" for e in decode(value, EndpointSet).endpoints]


class Registry:
    """``lig registry --kubernetes`` as a child process, its output in a log file."""

    def __init__(self, tmp_path: Path, kubeconfig: Path, nats_url: str, *extra: str) -> None:
        self.log = tmp_path / f"registry-{time.monotonic_ns()}.log"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [LIG, "registry", "--kubernetes", "--kubeconfig", str(kubeconfig),
                 "--nats-url", nats_url, "--metrics-port", "0", "--resync-interval", "0", *extra],
                stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)

    def text(self) -> str:
        return self.log.read_text()

    def stop(self) -> float:
        """SIGTERM; return how long it took to exit (kill after 10 s)."""
        start = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        return time.monotonic() - start


@pytest.fixture
def start_registry(kube: KubeApiServer, nats_server, tmp_path: Path):
    started: list[Registry] = []

    def start(*extra: str) -> Registry:
        kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
        started.append(Registry(tmp_path, kubeconfig, nats_server.url, *extra))
        return started[-1]

    yield start
    for registry in started:
        if registry.process.poll() is None:
            registry.stop()


async def reaches(nc: Client, check: Callable[[dict[str, bytes]], bool],
                  within: float = 10.0) -> float:
    """Seconds until the bucket's contents satisfy ``check``."""
    async def ok() -> bool:
        return check(await bucket(nc))
    return await poll_until(ok, within)


async def change_within(nc: Client, kube: KubeApiServer, change: Callable[[], Any],
                        check: Callable[[dict[str, bytes]], bool],
                        key: str = "endpoints.pool-a") -> None:
    """Make ``change`` and assert the registry stored it in ``key`` within the 1 s promise.

    Measured from the moment the watch event reached the kernel to the time NATS stamped the
    stored message with (one host, one wall clock): the test's own loop (serving the API,
    polling the bucket), which a loaded machine slows, is not in the measured span.
    """
    events_before = len(kube.sent)
    change()
    await reaches(nc, check)
    stored = await nc.jetstream().get_last_msg(KV_STREAM_TEMPLATE.format(bucket=BUCKET),
                                               KV_PRE_TEMPLATE.format(bucket=BUCKET) + key)
    assert stored.time is not None and len(kube.sent) > events_before
    took = stored.time.timestamp() - kube.sent[events_before]
    assert took < PROMISE, f"took {took:.2f} s"


async def test_pods_join_and_leave_with_readiness_within_a_second(
    kube: KubeApiServer, nc: Client, start_registry: Callable[[], Registry]
) -> None:
    kube.put(pool())
    kube.put(pod("vllm-0", "10.1.0.1"))
    kube.put(pod("no-ip", None))
    kube.put(pod("other", "10.1.0.9", app="b"))
    registry = start_registry()
    await reaches(nc, lambda c: endpoints(c) == ["vllm-0@10.1.0.1:8000"])

    await change_within(nc, kube, lambda: kube.put(pod("vllm-1", "10.1.0.2")),
                        lambda c: endpoints(c) == ["vllm-0@10.1.0.1:8000", "vllm-1@10.1.0.2:8000"])
    await change_within(nc, kube, lambda: kube.put(pod("vllm-0", "10.1.0.1", ready=False)),
                        lambda c: endpoints(c) == ["vllm-1@10.1.0.2:8000"])
    terminating = pod("vllm-1", "10.1.0.2")
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    await change_within(nc, kube, lambda: kube.put(terminating), lambda c: endpoints(c) == [])
    await change_within(nc, kube, lambda: kube.put(pod("vllm-0", "10.1.0.1")),
                        lambda c: endpoints(c) == ["vllm-0@10.1.0.1:8000"])
    await change_within(nc, kube, lambda: kube.delete("Pod", "vllm-0"),
                        lambda c: endpoints(c) == [])
    await change_within(nc, kube, lambda: kube.delete("InferencePool", "pool-a"),
                        lambda c: "pool.pool-a" not in c and "endpoints.pool-a" not in c)
    assert registry.stop() < STOP_S


async def test_selector_edit_moves_membership(
    kube: KubeApiServer, nc: Client, start_registry: Callable[[], Registry]
) -> None:
    kube.put(pool())
    kube.put(pod("a-0", "10.1.0.1", app="a"))
    kube.put(pod("b-0", "10.1.0.2", app="b", tier="gold"))
    start_registry()
    await reaches(nc, lambda c: endpoints(c) == ["a-0@10.1.0.1:8000"])
    await change_within(nc, kube, lambda: kube.put(pool(labels={"app": "b", "tier": "gold"})),
                        lambda c: endpoints(c) == ["b-0@10.1.0.2:8000"])
    # A pod relabelled out of the selector leaves.
    await change_within(nc, kube, lambda: kube.put(pod("b-0", "10.1.0.2", app="b")),
                        lambda c: endpoints(c) == [])


async def test_several_target_ports_are_several_endpoints(
    kube: KubeApiServer, nc: Client, start_registry: Callable[[], Registry]
) -> None:
    kube.put(pool(ports=(8000, 8001, 8002)))
    kube.put(pod("dp", "10.1.0.1"))
    start_registry()
    await reaches(nc, lambda c: endpoints(c) == [
        "dp-rank-0@10.1.0.1:8000", "dp-rank-1@10.1.0.1:8001", "dp-rank-2@10.1.0.1:8002"])


def lists(kube: KubeApiServer) -> int:
    """The pods' lists (not watches) the API server answered."""
    return sum("watch" not in r and "/pods" in r for r in kube.requests)


async def endpoint_history(nc: Client, key: str = "endpoints.pool-a") -> list[list[str] | None]:
    kv = await nc.jetstream().key_value(BUCKET)
    return [None if entry.value is None or entry.operation else
            [e.name for e in decode(entry.value, EndpointSet).endpoints]
            for entry in await kv.history(key)]


@pytest.mark.parametrize("gone_as_http", [False, True], ids=["error-event", "http-410"])
async def test_410_gone_forces_a_relist_without_a_gap(
    kube: KubeApiServer, nc: Client, start_registry: Callable[[], Registry], gone_as_http: bool
) -> None:
    kube.gone_as_http = gone_as_http
    kube.put(pool())
    kube.put(pod("vllm-0", "10.1.0.1"))
    registry = start_registry()
    await reaches(nc, lambda c: endpoints(c) == ["vllm-0@10.1.0.1:8000"])
    lists_before = sum("watch" not in r and "/pods" in r for r in kube.requests)
    # A change the open watches never see, then the history is compacted and the watches told
    # 410: the registry must list again to learn about vllm-1, and must not drop vllm-0 meanwhile.
    kube.close_watches()
    kube.put(pod("vllm-1", "10.1.0.2"))
    kube.compact()
    kube.expire_watches()
    await reaches(nc, lambda c: endpoints(c) == ["vllm-0@10.1.0.1:8000", "vllm-1@10.1.0.2:8000"])
    assert sum("watch" not in r and "/pods" in r for r in kube.requests) > lists_before
    assert "410 Gone" in registry.text() or "answered 410" in registry.text()
    assert await endpoint_history(nc) == [["vllm-0"], ["vllm-0", "vllm-1"]]


async def test_api_server_restart_keeps_the_state_and_catches_up(
    kube: KubeApiServer, nc: Client, start_registry: Callable[[], Registry]
) -> None:
    kube.put(pool())
    kube.put(pod("vllm-0", "10.1.0.1"))
    kube.put(objective("model-a", 1))
    registry = start_registry()
    await reaches(nc, lambda c: endpoints(c) == ["vllm-0@10.1.0.1:8000"] and "model.pool-a.model-a"
                  in c)
    before = await bucket(nc)
    await kube.stop()
    # While it is down, the registry keeps what it published (checked over a few retries).
    for _ in range(10):
        await asyncio.sleep(0.2)
        assert await bucket(nc) == before
    kube.put(pod("vllm-1", "10.1.0.2"))
    kube.delete("Pod", "vllm-0")
    kube.compact()  # the restarted server does not remember the registry's resourceVersion
    await kube.start()
    await reaches(nc, lambda c: endpoints(c) == ["vllm-1@10.1.0.2:8000"])
    assert "keeping the last state" in registry.text()
    assert await endpoint_history(nc) == [["vllm-0"], ["vllm-1"]]
    assert registry.stop() < STOP_S


def input_valid(port: int) -> float | None:
    page = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    values = [float(line.split()[1]) for line in page.splitlines()
              if line.startswith("lig_registry_input_valid ")]
    return values[0] if values else None


async def test_sigterm_stops_it_while_the_api_server_is_unreachable(
    kube: KubeApiServer, nc: Client, start_registry: Callable[..., Registry]
) -> None:
    await kube.stop()
    registry = start_registry()

    async def retrying() -> bool:
        return "keeping the last state, retrying" in registry.text()
    await poll_until(retrying)
    assert registry.stop() < STOP_S
    assert registry.process.returncode == 0
    assert await bucket(nc) == {}


async def test_bad_objects_are_logged_and_the_previous_good_state_kept(
    kube: KubeApiServer, nc: Client, start_registry: Callable[[], Registry]
) -> None:
    kube.put(pool())
    kube.put(pod("vllm-0", "10.1.0.1"))
    kube.put(objective("model-a", -1))
    kube.put(pool("never-good", labels={}))
    metrics_port = free_port()
    registry = start_registry("--metrics-port", str(metrics_port), "--host", "127.0.0.1")
    await reaches(nc, lambda c: endpoints(c) == ["vllm-0@10.1.0.1:8000"]
                  and "model.pool-a.model-a" in c)
    good = await bucket(nc)
    assert decode(good["model.pool-a.model-a"], InferenceModel).criticality == "Sheddable"
    assert "pool.never-good" not in good

    kube.put(pool(labels={}))
    kube.put(pool(ports=(70000,)))
    kube.put(pool(ports=tuple(range(8000, 8009))))
    kube.put(objective("model-a", "high"))
    expected = [
        "rejected InferencePool default/never-good",
        "spec.selector.matchLabels: no labels",
        "rejected InferencePool default/pool-a (resourceVersion",
        "spec.targetPorts",
        "9 ports (expected 1 to 8)",
        "rejected InferenceObjective default/model-a",
        "spec.priority: unknown priority 'high'",
        "its previous good version stays in use",
    ]

    async def logged() -> bool:
        return all(line in registry.text() for line in expected)
    await poll_until(logged)
    assert "Expected `int` <= 65535" in registry.text()
    assert input_valid(metrics_port) == 0.0
    # A good edit after the bad ones is used again.
    kube.put(pod("vllm-1", "10.1.0.2"))
    await reaches(nc, lambda c: endpoints(c) == ["vllm-0@10.1.0.1:8000", "vllm-1@10.1.0.2:8000"])
    # Fixing every bad object (or deleting it) makes the input valid again.
    kube.put(pool())
    kube.put(objective("model-a", -1))
    kube.delete("InferencePool", "never-good")
    await poll_until(lambda: asyncio.to_thread(lambda: input_valid(metrics_port) == 1.0))
    now = await bucket(nc)
    assert {k: v for k, v in now.items() if not k.startswith("endpoints.")} == {
        k: v for k, v in good.items() if not k.startswith("endpoints.")}


YAML_EQUIVALENT = [
    {"apiVersion": X, "kind": "InferencePool", "metadata": {"name": "pool-a"}, "spec": {
        "selector": {"app": "a"}, "targetPortNumber": 8000,
        "endpoints": [{"name": "vllm-0", "address": "10.1.0.1", "labels": {"app": "a"}}],
        "metrics": {"path": "/stats", "port": 9100},
        "scheduling": {"policy": "least-queue"}, "rejectUnknownModels": True,
        "objectives": {"chat": "Critical", "batch": "Sheddable", "llama3-base": "Critical"}}},
    {"apiVersion": X, "kind": "InferenceModel", "metadata": {"name": "chat"}, "spec": {
        "modelName": "chat", "criticality": "Critical", "poolRef": {"name": "pool-a"},
        "targetModels": [{"name": "chat-v1", "weight": 90}, {"name": "chat-v2", "weight": 10}]}},
    {"apiVersion": X, "kind": "InferenceModel", "metadata": {"name": "base"}, "spec": {
        "modelName": "meta/Llama-3", "criticality": "Critical", "poolRef": {"name": "pool-a"}}},
    {"apiVersion": X, "kind": "InferenceModel", "metadata": {"name": "batch"}, "spec": {
        "modelName": "batch", "criticality": "Sheddable", "poolRef": {"name": "pool-a"}}},
    {"apiVersion": X, "kind": "InferenceModel", "metadata": {"name": "alias"}, "spec": {
        "modelName": "alias", "poolRef": {"name": "pool-a"},
        "targetModels": [{"name": "chat-v2"}]}},
    {"apiVersion": X, "kind": "InferenceModel", "metadata": {"name": "legacy"}, "spec": {
        "modelName": "legacy", "criticality": "Standard", "poolRef": {"name": "pool-a"},
        "targetModels": [{"name": "legacy-lora", "weight": 3}]}},
]


async def test_models_are_the_entries_the_yaml_source_writes(
    kube: KubeApiServer, nc: Client, start_registry: Callable[[], Registry]
) -> None:
    kube.put(pool(annotations={
        "inference.lig.dev/metrics-path": "/stats", "inference.lig.dev/metrics-port": "9100",
        "inference.lig.dev/scheduling-policy": "least-queue",
        "inference.lig.dev/reject-unknown-models": "true"}))
    kube.put(pod("vllm-0", "10.1.0.1"))
    kube.put(objective("chat", 10))
    kube.put(objective("batch", -5))
    base = objective("llama3-base", 1)
    base["metadata"]["annotations"] = {"inference.lig.dev/model-name": "meta/Llama-3"}
    kube.put(base)
    kube.put(rewrite("chat-split", [(["chat"], [("chat-v1", 90), ("chat-v2", 10)]),
                                    (["alias"], [("chat-v2", 1)])]))
    legacy = {"apiVersion": X, "kind": "InferenceModel", "metadata": {"name": "legacy"},
              "spec": {"modelName": "legacy", "criticality": "Standard",
                       "poolRef": {"name": "pool-a"},
                       "targetModels": [{"name": "legacy-lora", "weight": 3}]}}
    kube.put(legacy)
    start_registry()
    from_yaml = desired_entries(load(FileSnapshot((SourceFile("eq.yaml",
                                                               dump(*YAML_EQUIVALENT)),))))
    took = await reaches(nc, lambda c: c == from_yaml)
    assert took < 10


async def test_only_the_watched_namespace_counts(
    kube: KubeApiServer, nc: Client, start_registry: Callable[..., Registry]
) -> None:
    kube.put(pool())
    kube.put(pod("here", "10.1.0.1"))
    elsewhere = pod("elsewhere", "10.1.0.2")
    elsewhere["metadata"]["namespace"] = "other"
    kube.put(elsewhere)
    other_pool = pool("pool-b")
    other_pool["metadata"]["namespace"] = "other"
    kube.put(other_pool)
    start_registry()
    await reaches(nc, lambda c: endpoints(c) == ["here@10.1.0.1:8000"])
    assert "pool.pool-b" not in await bucket(nc)
    await nc.jetstream().delete_key_value(BUCKET)
    start_registry("--namespace", "other")  # two registries, two namespaces, one bucket
    await reaches(nc, lambda c: endpoints(c, "pool-b") == ["elsewhere@10.1.0.2:8000"])


async def test_nothing_is_published_before_every_kind_is_listed(
    kube: KubeApiServer, nc: Client, start_registry: Callable[..., Registry]
) -> None:
    kube.put(pool())
    kube.put(pod("vllm-0", "10.1.0.1"))
    kube.answer_with["InferenceObjective"] = 500  # a kind the registry cannot list yet
    kube.answer_with["InferenceModel"] = 404  # the seed's CRD is not installed: no such objects
    registry = start_registry()

    async def retried() -> bool:
        return sum("inferenceobjectives" in r for r in kube.requests) >= 2
    await poll_until(retried)
    assert await bucket(nc) == {}, "published before the objectives were listed"
    del kube.answer_with["InferenceObjective"]
    await reaches(nc, lambda c: endpoints(c) == ["vllm-0@10.1.0.1:8000"])
    assert "InferenceModel: not served by the API server" in registry.text()


async def test_two_replicas_write_the_same_state(
    kube: KubeApiServer, nc: Client, start_registry: Callable[..., Registry]
) -> None:
    kube.put(pool())
    kube.put(pod("vllm-0", "10.1.0.1"))
    first, _second = start_registry(), start_registry()
    await reaches(nc, lambda c: endpoints(c) == ["vllm-0@10.1.0.1:8000"])
    await change_within(nc, kube, lambda: kube.put(pod("vllm-1", "10.1.0.2")),
                        lambda c: endpoints(c) == ["vllm-0@10.1.0.1:8000", "vllm-1@10.1.0.2:8000"])
    assert first.stop() < STOP_S
    await change_within(nc, kube, lambda: kube.delete("Pod", "vllm-0"),
                        lambda c: endpoints(c) == ["vllm-1@10.1.0.2:8000"])


async def test_a_silent_watch_is_replaced_by_a_fresh_list(
    kube: KubeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kube_source, "IDLE_SECONDS", 0.5)
    kube.put(pool())
    changes: list[int] = []
    state = KubeState()
    client = kube_source.make_client(str(kube.write_kubeconfig(tmp_path / "kubeconfig")), None)
    source = kube_source.KubeSource(client, state, lambda: changes.append(state.generation))
    task = asyncio.create_task(source.run())
    try:
        await asyncio.wait_for(source.synced.wait(), 10)
        await eventually(lambda: "Pod" in kube.watching(), what="the pods' watch open")
        kube.mute_watches()  # a connection dead without a FIN: nothing more arrives on it
        lists_before = lists(kube)
        kube.put(pod("vllm-0", "10.1.0.1"))

        async def seen() -> bool:
            return [e.name for e in state.registry().endpoint_sets[0].endpoints] == ["vllm-0"]
        await poll_until(seen)
        # Counted, not timed: the muted watch delivered nothing, so a fresh list taught it.
        assert lists(kube) > lists_before, "learnt without a list: the watch was not silent"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_priority_maps_onto_criticality() -> None:
    assert [criticality_of(p) for p in (None, -100, -1, 0, 1, 7)] == [
        Criticality.STANDARD, Criticality.SHEDDABLE, Criticality.SHEDDABLE,
        Criticality.STANDARD, Criticality.CRITICAL, Criticality.CRITICAL]


def test_conflicting_pool_names_keep_the_oldest() -> None:
    state = KubeState()
    newer = pool()
    newer["metadata"].update(namespace="b", creationTimestamp="2026-02-01T00:00:00Z",
                             resourceVersion="2")
    older = pool(ports=(9000,))
    older["metadata"].update(namespace="a", creationTimestamp="2026-01-01T00:00:00Z",
                             resourceVersion="1")
    state.apply(kube_objects.POOL, newer)
    state.apply(kube_objects.POOL, older)
    assert [p.target_port for p in state.registry().pools] == [9000]


def test_selector_matching_of_the_test_server() -> None:
    labels = {"app": "a", "tier": "gold"}
    assert matches("app=a,tier==gold", labels) and matches("app!=b,tier,!zone", labels)
    assert not matches("app=b", labels) and not matches("!tier", labels)
    with pytest.raises(ValueError):
        matches("app in (a,b)", labels)



def test_pods_outside_the_allowed_networks_are_left_out(caplog: pytest.LogCaptureFixture) -> None:
    # A pod IP outside the private ranges (or loopback, the node itself) would send prompts off
    # the cluster network: left out unless the pool's annotation allows its network.
    state = KubeState()
    state.apply(kube_objects.POOL, pool())
    for name, ip in (("in", "10.1.0.1"), ("public", "8.8.8.8"), ("node", "127.0.0.1")):
        state.apply(kube_objects.POD, pod(name, ip, app="a"))
    with caplog.at_level("WARNING"):
        members = state.registry().endpoint_sets[0].endpoints
    assert [e.name for e in members] == ["in"]
    assert "Pod default/public left out of pool pool-a: 8.8.8.8 is outside" in caplog.text
    assert "127.0.0.1 is a loopback address" in caplog.text

    allowing = pool()
    allowing["metadata"]["annotations"] = {
        "inference.lig.dev/allowed-networks": "10.0.0.0/8, 8.8.8.0/24"}
    allowing["metadata"]["resourceVersion"] = "2"
    state.apply(kube_objects.POOL, allowing)
    assert [e.name for e in state.registry().endpoint_sets[0].endpoints] == ["in", "public"]

    bad = pool()
    bad["metadata"]["annotations"] = {"inference.lig.dev/allowed-networks": "10.0.0.1/8"}
    bad["metadata"]["resourceVersion"] = "3"
    with caplog.at_level("ERROR"):
        state.apply(kube_objects.POOL, bad)
    assert "allowed-networks" in caplog.text and "not a network" in caplog.text


def test_a_pod_whose_ip_is_not_an_address_is_left_out(caplog: pytest.LogCaptureFixture) -> None:
    # The API server validates pod IPs, but the registry must not trust it to: a host name or
    # garbage would reach Envoy's original-destination cluster, which cannot resolve it.
    state = KubeState()
    state.apply(kube_objects.POOL, pool())
    for name, ip in (("good", "10.1.0.1"), ("named", "pod-b.local"), ("any", "0.0.0.0")):
        state.apply(kube_objects.POD, pod(name, ip, app="a"))
    with caplog.at_level("WARNING"):
        members = state.registry().endpoint_sets[0].endpoints
    assert [e.name for e in members] == ["good"]
    assert "Pod default/named left out of pool pool-a: 'pod-b.local' is not an IP address" \
        in caplog.text
    assert "Pod default/any left out of pool pool-a: '0.0.0.0' is the unspecified" in caplog.text


def test_objectives_reach_their_pool_by_their_own_name() -> None:
    # The objective header names an InferenceObjective; its model-name annotation may differ.
    state = KubeState()
    state.apply(kube_objects.POOL, pool())
    named = objective("latency-critical", 10)
    named["metadata"]["annotations"] = {"inference.lig.dev/model-name": "meta-llama/L-8B"}
    state.apply(kube_objects.OBJECTIVE, named)
    state.apply(kube_objects.OBJECTIVE, objective("batch", -1))
    state.apply(kube_objects.OBJECTIVE, objective("elsewhere", 5, pool_name="pool-b"))
    registry = state.registry()
    assert registry.pools[0].objectives == {"latency-critical": Criticality.CRITICAL,
                                            "batch": Criticality.SHEDDABLE}
    assert {m.model_name for m in registry.models} == {"meta-llama/L-8B", "batch"}
