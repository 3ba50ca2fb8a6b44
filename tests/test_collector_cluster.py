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

# A dead collector's pods move within two heartbeats (the product's promise); its own span is
# at most 1.5 heartbeats of silence, an eighth for the check, and a scrape interval. A 2 s
# heartbeat leaves 0.75 s of that promise, and NOISE_S more, to a loaded machine's lateness.
HEARTBEAT_S = 2.0
INTERVAL_S = 0.1
# Scrapes may fail on a loaded machine (which collector scraped a pod is read at the pod, so a
# timed-out scrape still counts): a short backoff cap keeps every pod scraped in each window.
FLAGS = ("--heartbeat", str(HEARTBEAT_S), "--interval", str(INTERVAL_S),
         "--scrape-timeout", "0.08", "--max-backoff", "0.3", "--record-max-age", "0")
# Allowance for a loaded 2-core machine on top of the two-heartbeat promise.
NOISE_S = 1.0
# A collector stops within a few seconds of SIGTERM (the product's promise).
STOP_S = 5.0


def agent(collector_id: str) -> str:
    return f"lig-collector/{collector_id}"


def scrapers(servers: list[PageServer], since: float, until: float) -> list[set[str]]:
    """For each pod, the collectors (User-Agents) that scraped it in [since, until)."""
    return [{r.user_agent for r in server.requests_since(since) if r.at < until}
            for server in servers]


def first_scrape_by(server: PageServer, collector_id: str, since: float) -> float | None:
    times = [r.at for r in server.requests_since(since) if r.user_agent == agent(collector_id)]
    return min(times) if times else None


def owner_of(server: PageServer, since: float, until: float) -> str | None:
    """The one collector scraping a pod in [since, until), or None if there is not exactly one.

    Counted, not timed: the collector a pod moved away from may have had one scrape in flight,
    which a loaded machine may deliver late; it may show once, before the owner's second scrape.
    Scraping it twice (or after that) is double scraping.
    """
    agents = [r.user_agent for r in server.requests_since(since) if r.at < until]
    owners = {a for a in agents if agents.count(a) >= 2}
    if len(owners) != 1:
        return None
    (owner,) = owners
    second = [i for i, a in enumerate(agents) if a == owner][1]
    return owner if all(a == owner for a in agents[second:]) else None


async def assert_split_without_double_scraping(servers: list[PageServer], ids: set[str]) -> None:
    """Over a 1.5 s window, every pod is scraped by exactly one collector, and all take part."""
    start = time.monotonic() + 0.3
    await eventually(lambda: time.monotonic() > start + 1.5, within=5)
    owners = [owner_of(server, start, start + 1.5) for server in servers]
    seen = scrapers(servers, start, start + 1.5)
    assert None not in owners, seen
    assert set(owners) == {agent(i) for i in ids}, seen


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
                assert wait_exit(b, within=STOP_S) <= STOP_S and b.returncode == 0
                await eventually(lambda: all(first_scrape_by(s, "c", left) for s in servers),
                                 within=10, what="c takes over from b")
                # A leaving collector says so: its pods move without waiting for expiry. Read in
                # c's log (why it took over), not timed: b's last heartbeat may have been sent
                # just before it left, so an expiry could come as soon as a leave would.
                await eventually(lambda: "collector b left; taking over its pods"
                                 in (tmp_path / "c.log").read_text(), what="b's leave heard")
                assert "stopped sending heartbeats" not in (tmp_path / "c.log").read_text()

                c.send_signal(signal.SIGTERM)
                assert wait_exit(c, within=STOP_S) <= STOP_S and c.returncode == 0
    print(f"takeover after kill: {takeover:.2f} s")
