"""``lig status``: table logic, the picker counter it reads, and a real NATS behind it."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest
from nats.js.api import KeyValueConfig, StreamConfig
from prometheus_client import CollectorRegistry, generate_latest

from lig.status import (
    PickerRow,
    PickerSource,
    Report,
    apply_stack_defaults,
    configure,
    latest_snapshots,
    pod_row,
    pool_rows,
    render,
    request_counts,
)
from lig.topology import StackInfo
from services.picker.observability import PickerMetrics
from shared.registry_view import RegistryView
from shared.schemas import (
    Endpoint,
    EndpointSet,
    InferenceModel,
    InferencePool,
    PodMetrics,
    encode,
)
from shared.subjects import Subjects, endpoints_key, pool_key
from tests.support.ports import free_port

NOW = 1_700_000_000_000_000_000
POOL = "pool-a"


def snapshot(pod: str, age_s: float, ok: bool = True, seq: int = 1, **fields: object
             ) -> PodMetrics:
    return PodMetrics(pool=POOL, pod=pod, address="127.0.0.1:8000", seq=seq,
                      scrape_time_ns=NOW - int(age_s * 1e9), scrape_duration_s=0.001, ok=ok,
                      error=None if ok else "connection refused", **fields)  # type: ignore[arg-type]


def test_pod_states_follow_age_and_scrape_outcome() -> None:
    fresh = pod_row(POOL, "a", "1.2.3.4:80", snapshot("a", 0.2, waiting=3, running=2,
                                                       kv_cache_usage=0.25,
                                                       running_adapters=("sql-lora",)),
                    NOW, stale_after=1.0)
    assert (fresh.state, fresh.waiting, fresh.running_adapters) == ("fresh", 3, ("sql-lora",))
    assert abs(fresh.age_s - 0.2) < 1e-9
    assert pod_row(POOL, "b", "x", snapshot("b", 1.5), NOW, 1.0).state == "stale"
    failing = pod_row(POOL, "c", "x", snapshot("c", 0.1, ok=False), NOW, 1.0)
    assert (failing.state, failing.error) == ("failing", "connection refused")
    assert pod_row(POOL, "d", "x", None, NOW, 1.0).state == "no data"


def test_request_counts_read_the_pickers_own_counter() -> None:
    registry = CollectorRegistry()
    metrics = PickerMetrics(registry)
    for _ in range(3):
        metrics.count_request("sql-lora", "sql-lora", True, "vllm-0", "routed")
    metrics.count_request("tweet-summary", "tweet-summary-1", True, "vllm-1", "routed")
    metrics.count_request("sql-lora", "sql-lora", True, "", "429")
    metrics.count_request("nope", "nope", False, "", "404")

    counts = request_counts(generate_latest(registry).decode())

    assert counts == {"routed": 4, "429": 1, "404": 1}


def test_render_shows_every_pod_and_picker() -> None:
    report = Report(
        nats_url="nats://127.0.0.1:4222", stale_after_s=1.0,
        pods=[pod_row(POOL, "vllm-0", "127.0.0.1:8000",
                      snapshot("vllm-0", 0.05, kv_cache_usage=0.5, max_lora=4,
                               running_adapters=("a", "b")), NOW, 1.0),
              pod_row(POOL, "vllm-1", "127.0.0.1:8001", None, NOW, 1.0)],
        pickers=[PickerRow("http://127.0.0.1:9090/metrics", {"routed": 7, "429": 2}),
                 PickerRow("http://127.0.0.1:9190/metrics", error="connection refused")],
    )
    text = render(report)
    lines = text.splitlines()
    assert lines[0] == ("NATS nats://127.0.0.1:4222: 0 pools, 2 pods, 1 fresh (snapshot younger "
                        "than 1s)")
    vllm0 = next(line for line in lines if " vllm-0 " in line)
    assert vllm0.split() == ["pool-a", "vllm-0", "127.0.0.1:8000", "fresh", "0.05s", "0", "0",
                             "50%", "a,b", "-", "4"]
    assert next(line for line in lines if " vllm-1 " in line).split()[3:5] == ["no", "data"]
    picker_header = next(line for line in lines if line.startswith("PICKER"))
    assert picker_header.split() == ["PICKER", "REQUESTS", "ROUTED", "429"]
    assert "http://127.0.0.1:9090/metrics  9 " in text
    assert "unreachable: connection refused" in text
    assert not report.all_fresh()


async def publish_registry(js: nats.js.JetStreamContext, members: list[Endpoint]) -> None:
    subjects = Subjects()
    kv = await js.create_key_value(KeyValueConfig(bucket=subjects.registry_bucket))
    await kv.put(pool_key(POOL), encode(InferencePool(name=POOL, target_port=8000)))
    await kv.put(endpoints_key(POOL), encode(EndpointSet(POOL, tuple(members))))


def run_status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lig.cli", "status", *args],
                          capture_output=True, text=True, timeout=30)


async def test_status_reads_registry_and_recorded_snapshots(nats_server, tmp_path: Path) -> None:
    members = [Endpoint(name, "127.0.0.1", 8000 + i) for i, name in
               enumerate(["fresh-pod", "old-pod", "broken-pod", "silent-pod"])]
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    subjects = Subjects()
    await publish_registry(js, members)
    await js.add_stream(StreamConfig(name=subjects.metrics_stream,
                                     subjects=[subjects.all_metrics()]))
    now = time.time_ns()
    for pod, age, ok in [("fresh-pod", 0, True), ("old-pod", 30, True), ("broken-pod", 0, False)]:
        await js.publish(subjects.metrics(POOL, pod), encode(PodMetrics(
            pool=POOL, pod=pod, address="127.0.0.1:8000", seq=1,
            scrape_time_ns=now - age * 1_000_000_000, scrape_duration_s=0.001, ok=ok,
            error=None if ok else "HTTP 500", waiting=4)))
    await nc.close()

    result = await asyncio.to_thread(run_status, "--nats-url", nats_server.url, "--json",
                                     "--stale-after", "20", "--state-dir", str(tmp_path))

    assert result.returncode == 1, result.stderr  # not every pod is fresh
    report = json.loads(result.stdout)
    states = {pod["pod"]: (pod["state"], pod["waiting"]) for pod in report["pods"]}
    assert states == {"fresh-pod": ("fresh", 4), "old-pod": ("stale", 4),
                      "broken-pod": ("failing", None), "silent-pod": ("no data", None)}
    assert report["pickers"] == []


async def test_status_listens_when_nothing_is_recorded_and_finds_lig_up(
        nats_server, tmp_path: Path) -> None:
    """Without the recording stream, snapshots heard during --window count; stack.json is read."""
    members = [Endpoint("pod-a", "127.0.0.1", 8000), Endpoint("pod-b", "127.0.0.1", 8001)]
    nc = await nats.connect(nats_server.url)
    await publish_registry(nc.jetstream(), members)
    picker_port = free_port()  # nothing listens there: the picker shows as unreachable
    StackInfo(nats_server.url, "lig", POOL, "http://127.0.0.1:1",
              [f"http://127.0.0.1:{picker_port}/metrics"], pid=os.getpid()).write(tmp_path)
    status = asyncio.create_task(asyncio.to_thread(
        run_status, "--json", "--window", "3", "--state-dir", str(tmp_path)))
    seq = 0
    while not status.done():
        seq += 1
        for member in members:
            await nc.publish(Subjects().metrics(POOL, member.name), encode(PodMetrics(
                pool=POOL, pod=member.name, address=member.hostport, seq=seq,
                scrape_time_ns=time.time_ns(), scrape_duration_s=0.001, ok=True, running=seq)))
        await asyncio.sleep(0.05)
    await nc.close()
    result = status.result()

    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["nats_url"] == nats_server.url
    assert [(p["pod"], p["state"]) for p in report["pods"]] == [("pod-a", "fresh"),
                                                                ("pod-b", "fresh")]
    assert all(p["running"] > 1 for p in report["pods"])  # a later snapshot than the first
    assert report["pickers"][0]["url"] == f"http://127.0.0.1:{picker_port}/metrics"
    assert report["pickers"][0]["error"]


async def test_latest_snapshot_wins_by_scrape_time(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    subjects = Subjects()

    async def publish_soon() -> None:
        await asyncio.sleep(0.3)
        for seq, age in [(5, 0.0), (9, 2.0)]:  # seq 9 from a restarted collector, but older
            await nc.publish(subjects.metrics(POOL, "p"), encode(snapshot("p", age, seq=seq)))

    publisher = asyncio.create_task(publish_soon())
    latest = await latest_snapshots(nc, subjects, [(POOL, "p")], window=1.0)
    await publisher
    await nc.close()
    assert latest[(POOL, "p")].seq == 5


def status_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("LIG_NATS_URL", raising=False)
        configure(parser)
    return parser.parse_args(list(argv))


def test_flags_win_over_the_running_stack_which_wins_over_defaults() -> None:
    stack = StackInfo("nats://127.0.0.1:5555", "other", POOL, "http://127.0.0.1:1",
                      ["http://127.0.0.1:9/metrics"], pid=os.getpid())
    settings, pickers = apply_stack_defaults(status_args(), stack)
    assert pickers == PickerSource(["http://127.0.0.1:9/metrics"], "the lig up stack in .lig")
    assert (settings.url, settings.prefix) == ("nats://127.0.0.1:5555", "other")

    settings, pickers = apply_stack_defaults(
        status_args("--nats-url", "nats://elsewhere:4222", "--picker-metrics", "http://x/m"),
        stack)
    assert pickers == PickerSource(["http://x/m"], "--picker-metrics")
    assert (settings.url, settings.prefix) == ("nats://elsewhere:4222", "lig")

    settings, pickers = apply_stack_defaults(status_args(), None)
    assert pickers == PickerSource([])
    assert settings.url == "nats://127.0.0.1:4222"


def test_a_stacks_pickers_are_listed_only_for_its_own_nats_and_prefix() -> None:
    stack = StackInfo("nats://127.0.0.1:5555", "other", POOL, "http://127.0.0.1:1",
                      ["http://127.0.0.1:9/metrics"], pid=os.getpid())
    _, pickers = apply_stack_defaults(
        status_args("--nats-url", "nats://127.0.0.1:5555", "--prefix", "other"), stack)
    assert pickers.urls == ["http://127.0.0.1:9/metrics"]

    for elsewhere in (["--nats-url", "nats://127.0.0.1:14222"],  # a replay's NATS
                      ["--nats-url", "nats://127.0.0.1:5555", "--prefix", "lig-replay"]):
        _, pickers = apply_stack_defaults(status_args(*elsewhere), stack)
        assert pickers.urls == [] and pickers.origin == ""
        assert pickers.left_out == (
            "The pickers of the lig up stack in .lig are not listed: they use NATS "
            "nats://127.0.0.1:5555 (prefix other), not the one read here; give this fleet's "
            "with --picker-metrics URL.")


def test_render_says_where_the_pickers_come_from_or_why_none_are_listed() -> None:
    pods = [pod_row(POOL, "vllm-0", "127.0.0.1:8000", snapshot("vllm-0", 0.05), NOW, 1.0)]
    listed = render(Report("nats://127.0.0.1:4222", 1.0, pods,
                           [PickerRow("http://127.0.0.1:9090/metrics", {"routed": 2})],
                           pickers_from="the lig up stack in .lig"))
    lines = listed.splitlines()
    origin = lines.index("Pickers from the lig up stack in .lig:")
    assert lines[origin + 1].split() == ["PICKER", "REQUESTS", "ROUTED"]

    left_out = render(Report("nats://127.0.0.1:14222", 1.0, pods, [],
                             pickers_left_out="The pickers of ... are not listed: ..."))
    assert left_out.splitlines()[-1] == "The pickers of ... are not listed: ..."
    assert "PICKER" not in left_out


def test_unreachable_nats_exits_2() -> None:
    result = run_status("--nats-url", f"nats://127.0.0.1:{free_port()}", "--timeout", "1")
    assert result.returncode == 2
    assert "cannot reach NATS" in result.stderr


def test_status_shows_every_pool_with_its_models_even_without_pods() -> None:
    view = RegistryView()
    for name in ("llama", "qwen"):
        view.pools[name] = InferencePool(name=name, target_port=8000)
    view.models["llama"] = {"sql-lora": InferenceModel(model_name="sql-lora", pool="llama"),
                            "base": InferenceModel(model_name="base", pool="llama")}
    view.models["qwen"] = {"poet": InferenceModel(model_name="poet", pool="qwen")}
    pods = [pod_row("llama", "llama-0", "127.0.0.1:8000", snapshot("llama-0", 0.05), NOW, 1.0),
            pod_row("llama", "llama-1", "127.0.0.1:8001", None, NOW, 1.0)]
    report = Report("nats://127.0.0.1:4222", 1.0, pods, [], pool_rows(view, pods))
    assert [(r.pool, r.pods, r.fresh, r.models) for r in report.pools] == [
        ("llama", 2, 1, ["base", "sql-lora"]), ("qwen", 0, 0, ["poet"])]
    lines = render(report).splitlines()
    assert lines[0].startswith("NATS nats://127.0.0.1:4222: 2 pools, 2 pods, 1 fresh")
    assert lines[2].split() == ["POOL", "PODS", "FRESH", "MODELS"]
    assert lines[3].split() == ["llama", "2", "1", "base,", "sql-lora"]
    assert lines[4].split() == ["qwen", "0", "0", "poet"]
