"""The collector against a real NATS and real HTTP pods: snapshots, errors, recording, restarts."""

from __future__ import annotations

import asyncio
import time

import httpx
import nats.errors
import pytest
from nats.js.errors import NotFoundError

from services.collector.recording import ensure_stream
from shared.nats_connection import NatsSettings, connect
from shared.schemas import InferencePool, PodMetrics, decode
from shared.subjects import endpoints_key
from tests.support.collector import (
    SUBJECTS,
    pod,
    put_pool,
    registry_bucket,
    running_collector,
    settings,
    snapshot_log,
)
from tests.support.metrics_pages import fixture_page
from tests.support.ports import free_port
from tests.support.waiting import eventually

V1 = fixture_page("vllm_v1.txt")
V0 = fixture_page("vllm_v0.txt")


async def test_snapshots_of_healthy_and_failing_pods(nats_server, page_servers) -> None:
    v1 = page_servers.start(V1)
    v0 = page_servers.start(V0)
    broken = page_servers.start(b"<html><body>502 Bad Gateway</body></html>\n")
    erroring = page_servers.start(V1, status=500)
    slow = page_servers.start(V1, delay_s=3.0)
    custom = page_servers.start(V0, path="/stats")  # the pool's own metrics port and path
    closed_port = free_port()
    pods = [pod("v1", v1.port), pod("v0", v0.port), pod("broken", broken.port),
            pod("erroring", erroring.port), pod("slow", slow.port), pod("closed", closed_port)]
    metrics_port = free_port()

    nc = await connect(NatsSettings(url=nats_server.url), "test")
    try:
        kv = await registry_bucket(nc)
        await put_pool(kv, InferencePool(name="main", target_port=8000), pods)
        await put_pool(kv, InferencePool(name="other", target_port=8000, metrics_path="stats",
                                         metrics_port=custom.port), [pod("custom", closed_port)])
        await kv.put(endpoints_key("garbage"), b"\x00not msgpack")
        async with snapshot_log(nc) as log, running_collector(
            settings(nats_server.url, metrics_port=metrics_port, host="127.0.0.1")
        ) as collector:
            started_ns = time.time_ns()
            names = ["v1", "v0", "broken", "erroring", "slow", "closed", "custom"]
            await eventually(lambda: all(log.latest(name) for name in names)
                             and len(log.of("v1")) >= 3, within=20, what="a snapshot of each")

            v1_snap = log.latest("v1")
            assert v1_snap is not None and v1_snap.ok and v1_snap.error is None
            assert (v1_snap.pool, v1_snap.address) == ("main", f"127.0.0.1:{v1.port}")
            assert (v1_snap.waiting, v1_snap.running, v1_snap.kv_cache_usage) == (7, 24, 0.4375)
            assert v1_snap.running_adapters == ("sql-lora", "chat-lora")
            assert v1_snap.waiting_adapters == ("summarize-lora",)
            assert (v1_snap.max_lora, v1_snap.block_size, v1_snap.num_gpu_blocks) == (
                4, 16, 27910)
            assert v1_snap.missing == ()
            assert v1_snap.scrape_duration_s > 0
            assert started_ns - 5e9 < v1_snap.scrape_time_ns <= time.time_ns()
            seqs = [snapshot.seq for snapshot in log.of("v1")]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

            for name in ("v0", "custom"):
                snap = log.latest(name)
                assert snap is not None and snap.ok, snap
                assert (snap.waiting, snap.running, snap.kv_cache_usage) == (2, 9, 0.8125)
                assert (snap.running_adapters, snap.waiting_adapters, snap.max_lora) == (
                    (), (), 2)
                assert (snap.block_size, snap.num_gpu_blocks) == (16, 12850)
                assert snap.missing == ()  # V0 has gpu_cache_usage_perc instead
            assert log.latest("custom").pool == "other"  # type: ignore[union-attr]

            expected_errors = {"broken": "unparsable metrics page", "erroring": "HTTP 500",
                               "slow": "timeout", "closed": "connect failed"}
            for name, error in expected_errors.items():
                snap = log.latest(name)
                assert snap is not None and not snap.ok, snap
                assert error in (snap.error or ""), snap.error
                assert (snap.waiting, snap.running, snap.kv_cache_usage) == (0, 0, 0.0)
            # Cut at the timeout (1 s), not waiting for the answer the pod sends after 3 s.
            assert log.latest("slow").scrape_duration_s < slow.delay_s  # type: ignore[union-attr]

            # The stream recorded them.
            js = nc.jetstream()
            info = await js.stream_info(SUBJECTS.metrics_stream)
            assert info.config.max_age == 3600 and info.state.messages > 0
            recorded = await js.get_last_msg(SUBJECTS.metrics_stream,
                                             SUBJECTS.metrics("main", "v0"))
            assert decode(recorded.data, PodMetrics).waiting == 2

            # Its own metrics, on its metrics port.
            async with httpx.AsyncClient() as client:
                page = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
            for line in ('lig_collector_scrapes_total{outcome="ok"}',
                         'lig_collector_scrapes_total{outcome="timeout"}',
                         'lig_collector_scrapes_total{outcome="connect_error"}',
                         'lig_collector_scrapes_total{outcome="http_status"}',
                         'lig_collector_scrapes_total{outcome="bad_page"}',
                         "lig_collector_scrape_duration_seconds_count",
                         "lig_collector_parse_duration_seconds_count",
                         "lig_collector_snapshots_published_total"):
                assert line in page, line
            assert "lig_collector_pods_owned 7.0" in page
            assert 'lig_collector_undecodable_messages_total{source="registry"} 1.0' in page

            # A pod removed from the registry is no longer scraped.
            await put_pool(kv, InferencePool(name="main", target_port=8000), pods[1:])
            await eventually(lambda: "v1" not in {
                t.pod for t in collector.scrape_supervisor.targets.values()}, what="v1 dropped")
            # Counted, not timed: a scrape already in flight may still reach v1 (a loaded
            # machine may delay it by any time), but no more than that one.
            removed_at = time.monotonic()
            v1_before = len(v1.requests)
            # Three more scrapes of another pod: as many rounds as v1 would have had.
            await eventually(lambda: len(v0.requests_since(removed_at)) >= 3, within=20,
                             what="three more rounds of scrapes")
            assert len(v1.requests) <= v1_before + 1, v1.requests[v1_before:]
    finally:
        await nc.close()


async def test_failing_pod_is_backed_off_and_its_return_noticed(nats_server, page_servers) -> None:
    flaky = page_servers.start(V1, status=503)
    nc = await connect(NatsSettings(url=nats_server.url), "test")
    try:
        kv = await registry_bucket(nc)
        await put_pool(kv, InferencePool(name="main", target_port=8000), [pod("flaky", flaky.port)])
        async with snapshot_log(nc) as log, running_collector(
            # interval 1.1 s, timeout 1 s (which a loaded machine meets: the recovery below
            # needs a scrape that succeeds), backoff cap 4.4 s
            settings(nats_server.url)
        ):
            await eventually(lambda: len(log.of("flaky")) >= 3, within=20)
            failing = log.of("flaky")
            assert not any(snapshot.ok for snapshot in failing)
            # Scrapes are due on a grid: the k-th at the first's due time plus 2x, 2x + 4x the
            # interval. Measured from the first scrape, a late timer only makes a gap longer; a
            # gap between two later scrapes would shrink by the lateness of the earlier one. The
            # 0.03 s is the few statements between the first's due time and its start.
            since_first = [(later.scrape_time_ns - failing[0].scrape_time_ns) / 1e9
                           for later in failing[1:3]]
            assert since_first[0] >= 2.2 - 0.03 and since_first[1] >= 2.2 + 4.4 - 0.03, \
                since_first
            flaky.status = 200
            # The next scrape is due within the cap (4.4 s); the bound is not what is tested
            # (the cap is, in test_collector_units.py).
            await eventually(lambda: log.latest("flaky").ok, within=20,  # type: ignore[union-attr]
                             what="recovery after the backoff")
    finally:
        await nc.close()


async def test_publishing_and_registry_watch_resume_after_nats_restart(
    nats_server, page_servers
) -> None:
    first = page_servers.start(V1)
    second = page_servers.start(V0)
    nc = await connect(NatsSettings(url=nats_server.url), "test")
    try:
        kv = await registry_bucket(nc)
        await put_pool(kv, InferencePool(name="main", target_port=8000), [pod("a", first.port)])
        async with snapshot_log(nc) as log, running_collector(
            settings(nats_server.url)
        ) as collector:
            await eventually(lambda: log.latest("a") is not None, within=10)
            nats_server.stop()
            await eventually(lambda: (collector.metrics.prometheus.get_sample_value(
                "lig_collector_publish_errors_total", {"reason": "disconnected"}) or 0) > 0,
                within=10, what="snapshots dropped (and counted) while NATS is down")
            nats_server.start()
            restarted_ns = time.time_ns()
            await eventually(lambda: any(snapshot.scrape_time_ns > restarted_ns
                                         for snapshot in log.of("a")),
                             within=10, what="snapshots after the restart")

            # The KV watch was re-created: a change made after the restart is seen.
            for _ in range(50):  # JetStream needs a moment after a restart
                try:
                    kv = await nc.jetstream().key_value(SUBJECTS.registry_bucket)
                    await put_pool(kv, InferencePool(name="main", target_port=8000),
                                   [pod("a", first.port), pod("b", second.port)])
                    break
                except nats.errors.Error:
                    await asyncio.sleep(0.1)
            await eventually(lambda: log.latest("b") is not None, within=10)
            assert log.latest("b").ok  # type: ignore[union-attr]
    finally:
        await nc.close()


async def test_recording_stream_is_created_aligned_or_left_out(nats_server, page_servers) -> None:
    nc = await connect(NatsSettings(url=nats_server.url), "test")
    js = nc.jetstream()
    try:
        await js.add_stream(name=SUBJECTS.metrics_stream, subjects=["lig.metrics.x.>"], max_age=10)
        assert await ensure_stream(js, SUBJECTS, 3600) == "updated"
        info = await js.stream_info(SUBJECTS.metrics_stream)
        assert (info.config.subjects, info.config.max_age) == ([SUBJECTS.all_metrics()], 3600)
        assert await ensure_stream(js, SUBJECTS, 3600) == "unchanged"
        await js.delete_stream(SUBJECTS.metrics_stream)

        server = page_servers.start(V1)
        kv = await registry_bucket(nc)
        await put_pool(kv, InferencePool(name="main", target_port=8000), [pod("a", server.port)])
        async with snapshot_log(nc) as log, running_collector(
            settings(nats_server.url, record_max_age_s=0.0)
        ):
            await eventually(lambda: log.latest("a") is not None, within=10)
        with pytest.raises(NotFoundError):
            await js.stream_info(SUBJECTS.metrics_stream)
    finally:
        await nc.close()
