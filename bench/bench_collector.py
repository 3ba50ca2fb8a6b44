"""Benchmark one ``lig collector`` process: scrapes per second, CPU per scrape, and latency.

    .venv/bin/python bench/bench_collector.py [--loads 50x20,100x20,150x20] [--seconds 5]

Setup, all on 127.0.0.1: a real nats-server (recording stream on, as by default), one cheap
page-server process (a bare asyncio protocol answering every request on N ports with the same
pre-built ~60 KB vLLM V1 page, tests/fixtures/metrics/vllm_v1.txt), and the registry entries
for N pods. The collector runs as ``lig collector`` in its own process; a subscriber here
receives every snapshot.

For each load ``PODSxHZ`` it reports over one-second samples (medians): successful
pod-scrapes per second received, the collector's CPU (from /proc) per scrape and as a share of
one core, and, over every snapshot, the latency from the end of its scrape to the subscriber
(p50/p99) and from the start of its scrape. Targets (issue 4): >= 1,000 scrapes/s sustained,
p99 scrape-end-to-subscriber <= 5 ms at 50 pods x 20 Hz.

Baseline, measured in the same run: the obvious scraper, one default ``httpx.AsyncClient``
shared by 50 concurrent loops fetching the same page as fast as they can (HTTP only, no parse,
no publish), CPU per GET.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import uvloop
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from shared.nats_connection import NatsSettings, connect
from shared.schemas import (
    Endpoint,
    EndpointSet,
    InferencePool,
    PodMetrics,
    decode,
    encode,
)
from shared.subjects import Subjects, endpoints_key, pool_key
from tests.support.nats_server import NatsServer
from tests.support.ports import free_port

PAGE = Path(__file__).resolve().parents[1] / "tests/fixtures/metrics/vllm_v1.txt"
LIG = Path(sys.executable).with_name("lig")
CLOCK_TICK = os.sysconf("SC_CLK_TCK")
SUBJECTS = Subjects()
TARGET_RATE = 1000.0
TARGET_P99_MS = 5.0


# --- the pods: one process, one listening socket per pod, a pre-built response -------------

def _serve_pages(sockets: list[socket.socket], response: bytes) -> None:
    class Pod(asyncio.Protocol):
        # typeshed keeps BaseProtocol's BaseTransport here, but a stream protocol is always
        # given a Transport (uvloop's is no subclass of asyncio.Transport: no isinstance).
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self.transport = transport
            self.buffer = b""

        def data_received(self, data: bytes) -> None:
            self.buffer += data
            while (end := self.buffer.find(b"\r\n\r\n")) >= 0:  # one response per request
                self.buffer = self.buffer[end + 4:]
                self.transport.write(response)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sock in sockets:
            await loop.create_server(Pod, sock=sock)
        await asyncio.Event().wait()

    uvloop.run(main())


def start_pods(count: int) -> tuple[BaseProcess, list[int]]:
    """A page-server process with ``count`` listening ports."""
    page = PAGE.read_bytes()
    response = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                b"Content-Length: %d\r\n\r\n" % len(page)) + page
    sockets: list[socket.socket] = []
    for _ in range(count):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        sockets.append(sock)
    process = multiprocessing.get_context("fork").Process(
        target=_serve_pages, args=(sockets, response), daemon=True)
    process.start()
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return process, ports


# --- CPU of another process ------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


# --- baseline: the obvious httpx scraper -----------------------------------------------------

def _baseline(ports: list[int], seconds: float,
              out: multiprocessing.Queue[tuple[float, float]]) -> None:
    async def main() -> None:
        async with httpx.AsyncClient() as client:
            deadline = time.monotonic() + seconds
            count = 0

            async def fetch(port: int) -> None:
                nonlocal count
                while time.monotonic() < deadline:
                    (await client.get(f"http://127.0.0.1:{port}/metrics")).raise_for_status()
                    count += 1

            await asyncio.gather(*(fetch(port) for port in ports[:5]))  # warm up
            count = 0
            deadline = time.monotonic() + seconds
            before = resource.getrusage(resource.RUSAGE_SELF)
            await asyncio.gather(*(fetch(port) for port in ports))
            after = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            out.put((count / seconds, cpu / count))

    uvloop.run(main())


def measure_baseline(ports: list[int], seconds: float) -> tuple[float, float]:
    """(GETs per second, CPU seconds per GET) of the naive scraper, in its own process."""
    out: multiprocessing.Queue[tuple[float, float]] = multiprocessing.get_context("fork").Queue()
    process = multiprocessing.get_context("fork").Process(
        target=_baseline, args=(ports, seconds, out))
    process.start()
    result = out.get(timeout=seconds + 60)
    process.join()
    return result


# --- the collector under load ----------------------------------------------------------------

class Receiver:
    """Every snapshot, with the latencies measured on arrival."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[float, bool, float, float]] = []  # (mono, ok, from end, start)

    async def on_message(self, msg: Msg) -> None:
        now_ns = time.time_ns()
        snapshot = decode(msg.data, PodMetrics)
        end_ns = snapshot.scrape_time_ns + snapshot.scrape_duration_s * 1e9
        self.arrivals.append((time.monotonic(), snapshot.ok, (now_ns - end_ns) / 1e6,
                              (now_ns - snapshot.scrape_time_ns) / 1e6))

    def window(self, start: float, end: float) -> list[tuple[float, bool, float, float]]:
        return [a for a in self.arrivals if start <= a[0] < end]


async def set_pods(kv: KeyValue, ports: list[int]) -> None:
    endpoints = tuple(Endpoint(f"pod-{i}", "127.0.0.1", port) for i, port in enumerate(ports))
    await kv.put(pool_key("bench"), encode(InferencePool(name="bench", target_port=8000)))
    await kv.put(endpoints_key("bench"), encode(EndpointSet(pool="bench", endpoints=endpoints)))


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


async def run_load(nats_url: str, ports: list[int], pods: int, hz: float,
                   seconds: int) -> dict[str, float]:
    """Run a fresh collector against ``pods`` pods at ``hz`` and measure it."""
    nc = await connect(NatsSettings(url=nats_url), "bench")
    kv = await nc.jetstream().create_key_value(bucket=SUBJECTS.registry_bucket)
    await set_pods(kv, ports[:pods])
    receiver = Receiver()
    await nc.subscribe(SUBJECTS.all_metrics(), cb=receiver.on_message)
    interval = 1.0 / hz
    collector = await asyncio.create_subprocess_exec(
        str(LIG), "collector", "--nats-url", nats_url, "--collector-id", "bench",
        "--interval", str(interval), "--metrics-port", "0", "--heartbeat", "1",
        "--log-level", "WARNING")
    try:
        # Settle: the collector joins, learns it is alone, and its loops spread out.
        await asyncio.sleep(3.0)
        samples = []
        for _ in range(seconds):
            start, cpu_start = time.monotonic(), cpu_seconds(collector.pid)
            await asyncio.sleep(1.0)
            end, cpu_end = time.monotonic(), cpu_seconds(collector.pid)
            arrivals = receiver.window(start, end)
            ok = sum(1 for a in arrivals if a[1])
            samples.append((ok / (end - start), (cpu_end - cpu_start) / max(len(arrivals), 1),
                            (cpu_end - cpu_start) / (end - start),
                            len(arrivals) - ok))
        measured = receiver.window(time.monotonic() - seconds - 0.01, time.monotonic())
        from_end = [a[2] for a in measured]
        from_start = [a[3] for a in measured]
    finally:
        collector.terminate()
        await asyncio.wait_for(collector.wait(), 10)
        await nc.close()
    return {
        "demand": pods * hz,
        "rate": statistics.median(s[0] for s in samples),
        "cpu_per_scrape_us": statistics.median(s[1] for s in samples) * 1e6,
        "cpu_share": statistics.median(s[2] for s in samples),
        "failed_per_s": statistics.median(s[3] for s in samples),
        "p50_end_ms": percentile(from_end, 0.5),
        "p99_end_ms": percentile(from_end, 0.99),
        "p50_start_ms": percentile(from_start, 0.5),
        "p99_start_ms": percentile(from_start, 0.99),
    }


def parse_loads(text: str) -> list[tuple[int, float]]:
    loads = []
    for item in text.split(","):
        pods, hz = item.lower().split("x")
        loads.append((int(pods), float(hz)))
    return loads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", default="50x20,75x20,100x20",
                        help="comma-separated PODSxHZ loads (default %(default)s)")
    parser.add_argument("--seconds", type=int, default=5, help="one-second samples per load")
    args = parser.parse_args()
    loads = parse_loads(args.loads)

    pods_process, ports = start_pods(max(pods for pods, _ in loads))
    baseline_rate, baseline_cpu = measure_baseline(ports[:50], 3.0)
    print(f"page: {PAGE.name} ({PAGE.stat().st_size / 1000:.1f} KB); cores: {os.cpu_count()}; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    print(f"baseline (shared default httpx.AsyncClient, 50 loops, GET only): "
          f"{baseline_rate:,.0f} GET/s, {baseline_cpu * 1e6:,.0f} µs CPU per GET")

    results = []
    with tempfile.TemporaryDirectory() as store:
        server = NatsServer(Path(store), port=free_port())
        server.start()
        try:
            for pods, hz in loads:
                results.append((pods, hz, uvloop.run(
                    run_load(server.url, ports, pods, hz, args.seconds))))
        finally:
            server.stop()
            pods_process.terminate()

    print(f"\n{'load':>9} {'demand/s':>9} {'ok/s':>7} {'failed/s':>8} {'CPU/scrape':>11} "
          f"{'vs base':>7} {'core':>5} {'end→sub p50/p99 ms':>19} {'start→sub p50/p99':>18}")
    for pods, hz, r in results:
        print(f"{pods:>4}x{hz:<4g} {r['demand']:>9,.0f} {r['rate']:>7,.0f} "
              f"{r['failed_per_s']:>8,.0f} {r['cpu_per_scrape_us']:>8,.0f} µs "
              f"{r['cpu_per_scrape_us'] / (baseline_cpu * 1e6):>6.2f}x {r['cpu_share']:>5.0%} "
              f"{r['p50_end_ms']:>9.2f} / {r['p99_end_ms']:<6.2f} "
              f"{r['p50_start_ms']:>8.2f} / {r['p99_start_ms']:<6.2f}")
    print(f"load average after: {os.getloadavg()[0]:.2f} (other processes share these cores)")
    best = max(r["rate"] for _, _, r in results)
    at_target = next((r for pods, hz, r in results if (pods, hz) == (50, 20)), None)
    cpu_us = statistics.median(r["cpu_per_scrape_us"] for _, _, r in results)
    print(f"\nsustained: {best:,.0f} ok scrapes/s (target >= {TARGET_RATE:,.0f}); median CPU "
          f"per scrape {cpu_us:,.0f} µs, i.e. ≈ {1e6 / cpu_us:,.0f} scrapes/s per core")
    if at_target is not None:
        print(f"50 pods x 20 Hz: p99 scrape end → subscriber {at_target['p99_end_ms']:.2f} ms "
              f"(target <= {TARGET_P99_MS} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
