"""Several ``lig collector`` processes sharing the pods: split, join, death, leave, SIGTERM.

Which collector scraped a pod is read at the pods themselves: each collector's User-Agent names
it, and every page server records the requests it got.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from shared.nats_connection import NatsSettings, connect
from shared.schemas import InferencePool
from tests.support.collector import collector_process, pod, put_pool, registry_bucket
from tests.support.metrics_pages import PageServer, PageServers, fixture_page
from tests.support.waiting import eventually

HEARTBEAT_S = 1.0
INTERVAL_S = 0.1
FLAGS = ("--heartbeat", str(HEARTBEAT_S), "--interval", str(INTERVAL_S),
         "--scrape-timeout", "0.08", "--record-max-age", "0")
# Allowance for a loaded 2-core machine on top of the two-heartbeat promise.
NOISE_S = 0.5


def agent(collector_id: str) -> str:
    return f"lig-collector/{collector_id}"


def scrapers(servers: list[PageServer], since: float, until: float) -> list[set[str]]:
    """For each pod, the collectors (User-Agents) that scraped it in [since, until)."""
    return [{r.user_agent for r in server.requests_since(since) if r.at < until}
            for server in servers]


def first_scrape_by(server: PageServer, collector_id: str, since: float) -> float | None:
    times = [r.at for r in server.requests_since(since) if r.user_agent == agent(collector_id)]
    return min(times) if times else None


async def assert_split_without_double_scraping(servers: list[PageServer], ids: set[str]) -> None:
    """Over a 1.5 s window, every pod is scraped by exactly one collector, and all take part.

    The window opens a little after the handover, so that a scrape already in flight when a pod
    moved (its response just arriving at the pod's server) does not count as a double.
    """
    start = time.monotonic() + 0.3
    await eventually(lambda: time.monotonic() > start + 1.5, within=5)
    seen = scrapers(servers, start, start + 1.5)
    assert all(len(who) == 1 for who in seen), seen
    assert set.union(*seen) == {agent(i) for i in ids}, seen


def wait_exit(process: subprocess.Popen[bytes], within: float) -> float:
    started = time.monotonic()
    process.wait(timeout=within)
    return time.monotonic() - started


async def test_collectors_split_pods_and_take_over_from_dead_or_leaving_ones(
    nats_server, page_servers: PageServers, tmp_path: Path
) -> None:
    page = fixture_page("vllm_v1.txt")
    servers = [page_servers.start(page) for _ in range(8)]
    nc = await connect(NatsSettings(url=nats_server.url), "test")
    kv = await registry_bucket(nc)
    await put_pool(kv, InferencePool(name="main", target_port=8000),
                   [pod(f"pod-{i}", server.port) for i, server in enumerate(servers)])
    await nc.close()

    url = nats_server.url
    with collector_process(url, "a", *FLAGS, log_path=tmp_path / "a.log") as a:
        t0 = time.monotonic()
        await eventually(lambda: all(first_scrape_by(s, "a", t0) for s in servers), within=10,
                         what="a alone scrapes every pod")

        with collector_process(url, "b", *FLAGS, log_path=tmp_path / "b.log") as b:
            # A joiner first learns its peers, then takes its share as the other hands it over.
            await eventually(lambda: any(first_scrape_by(s, "b", t0) for s in servers),
                             within=10, what="b takes a share")
            await assert_split_without_double_scraping(servers, {"a", "b"})

            a.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            a.wait()
            await eventually(lambda: all(first_scrape_by(s, "b", killed) for s in servers),
                             within=2 * HEARTBEAT_S + NOISE_S + 1, what="b takes over from a")
            takeover = max(first_scrape_by(s, "b", killed) for s in servers) - killed
            assert takeover <= 2 * HEARTBEAT_S + NOISE_S, f"takeover took {takeover:.2f} s"

            with collector_process(url, "c", *FLAGS, log_path=tmp_path / "c.log") as c:
                t1 = time.monotonic()
                await eventually(lambda: any(first_scrape_by(s, "c", t1) for s in servers),
                                 within=10, what="c takes a share")
                await assert_split_without_double_scraping(servers, {"b", "c"})

                b.send_signal(signal.SIGTERM)
                left = time.monotonic()
                assert wait_exit(b, within=2.0) <= 2.0 and b.returncode == 0
                # A leaving collector says so: its pods move without waiting for expiry.
                await eventually(lambda: all(first_scrape_by(s, "c", left) for s in servers),
                                 within=HEARTBEAT_S, what="c takes over from b at once")

                c.send_signal(signal.SIGTERM)
                assert wait_exit(c, within=2.0) <= 2.0 and c.returncode == 0
    print(f"takeover after kill: {takeover:.2f} s")
