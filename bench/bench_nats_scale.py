"""The NATS scale model, measured: what each message costs, and a 1,000-pod fleet at 20 Hz
through one NATS into one real picker.

Per-message costs (each next to a baseline measured in the same run):

- snapshot publish: encode a ``PodMetrics`` and publish it, CPU per message in the publishing
  process; baseline: publishing the same bytes already encoded (what nats-py alone costs);
- snapshot ingest: a subscriber process receiving snapshots and applying them to a picker's pod
  table of 1,000 pods (``SnapshotSink.accept``), CPU per message; baseline: the same
  subscription with a callback that does nothing (nats-py's receive path alone);
- decision event: publishing a decision-sized message (~120 bytes msgpack) per request, CPU per
  message; baseline: an empty publish;
- KV update: ``kv.put`` of an endpoint set, latency and CPU per put on one server (R1) and on a
  3-node cluster with R3 (the baseline is R1).

Fleet run: a feed process publishes a snapshot for each of ``--pods`` pods ``--hz`` times a
second (1,000 x 20 = 20,000 messages/s), matching the endpoints the registry bucket lists, into
a ``lig picker`` process serving that pool. The picker's CPU (from /proc) is measured in windows
with the feed running and, as the baseline, with the feed paused; the difference per received
message is what state costs the picker. Medians over ``--windows`` windows.

Run: ``.venv/bin/python bench/bench_nats_scale.py [--pods 1000] [--hz 20] [--window 2]``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.connection
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import nats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_collector import cpu_seconds
from services.collector.recording import ensure_stream
from services.picker.metrics_feed import SnapshotSink
from services.picker.state import PodTable
from shared.schemas import Endpoint, EndpointSet, PodMetrics, encode
from shared.subjects import Subjects, endpoints_key
from tests.support.fleet_feed import FleetFeed
from tests.support.nats_cluster import NatsCluster
from tests.support.nats_server import NatsServer
from tests.support.picker import PickerProcess

POOL = "scale"
SUBJECTS = Subjects()
MESSAGES = 20_000  # per micro measurement; bounded
RECORD_MAX_AGE_S = 10.0  # the recording keeps little: the disk is shared


def endpoints(pods: int) -> list[Endpoint]:
    """``pods`` endpoints on distinct private addresses."""
    return [Endpoint(f"pod-{i}", f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", 8000)
            for i in range(pods)]


def snapshot(endpoint: Endpoint, seq: int) -> PodMetrics:
    """A realistic snapshot: some load, two adapters, cache info."""
    return PodMetrics(
        pool=POOL, pod=endpoint.name, address=endpoint.hostport, seq=seq,
        scrape_time_ns=time.time_ns(), scrape_duration_s=0.002, ok=True, waiting=3, running=7,
        kv_cache_usage=0.42, running_adapters=("sql-lora", "tweet-summary-1"),
        waiting_adapters=(), max_lora=4, block_size=16, num_gpu_blocks=27_000)


# --- child processes: a feed that publishes, a subscriber that measures itself --------------

def _feed(url: str, pods: int, hz: float, seconds: float, control: Any, counter: Any) -> None:
    """Publish one snapshot per pod every 1/hz s for ``seconds`` while ``control`` is set.

    The load generator speaks the NATS protocol itself (one ``PUB`` per snapshot, one socket
    write per round): nats-py's per-message publish costs more than everything else here, and a
    feed that falls behind on a busy machine would measure the feed, not the picker.
    """
    host, _, port = url.removeprefix("nats://").partition(":")
    members = endpoints(pods)
    subjects = [SUBJECTS.metrics(POOL, e.name).encode() for e in members]
    with socket.create_connection((host, int(port))) as sock:
        sock.recv(4096)  # INFO
        sock.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\n')
        seq = 0
        tick = 1.0 / hz
        deadline = time.monotonic() + seconds
        next_tick = time.monotonic()
        while time.monotonic() < deadline:
            if control.is_set():
                seq += 1
                batch = bytearray()
                for endpoint, subject in zip(members, subjects, strict=True):
                    payload = encode(snapshot(endpoint, seq))
                    batch += b"PUB %s %d\r\n%s\r\n" % (subject, len(payload), payload)
                sock.sendall(batch)
                counter.value += pods
            next_tick += tick
            time.sleep(max(0.0, next_tick - time.monotonic()))


def _subscriber(url: str, apply: bool, pods: int, ready: Any, conn: Any) -> None:
    """Receive snapshots (applying them to a pod table, or not) and report (messages, CPU)."""
    import uvloop

    async def main() -> None:
        table = PodTable(stale_after=1.0)
        table.set_endpoints(endpoints(pods))
        sink = SnapshotSink({POOL: table}.get)
        count = 0

        async def on_message(message: Any) -> None:
            nonlocal count
            count += 1
            if apply:
                sink.accept(message.subject, message.data)

        nc = await nats.connect(url)
        await nc.subscribe(SUBJECTS.pool_metrics(POOL), cb=on_message, pending_msgs_limit=-1,
                           pending_bytes_limit=-1)
        await nc.flush()
        ready.set()
        started_cpu, started_count = time.process_time(), count
        expected = await asyncio.to_thread(conn.recv)  # the publisher is done
        # Drain what is in flight: until all arrived, or nothing arrived for a second.
        last, quiet_since = -1, time.monotonic()
        while count - started_count < expected and time.monotonic() - quiet_since < 1.0:
            if count != last:
                last, quiet_since = count, time.monotonic()
            await asyncio.sleep(0.05)
        conn.send((count - started_count, time.process_time() - started_cpu))
        await nc.close()
    uvloop.run(main())


# --- per-message costs ----------------------------------------------------------------------

async def publish_cpu(url: str, make: Callable[[int], tuple[str, bytes]], count: int) -> float:
    """CPU seconds per message for publishing ``make(i)`` ``count`` times (flushed)."""
    nc = await nats.connect(url, pending_size=64 * 1024 * 1024)
    try:
        started = time.process_time()
        for i in range(count):
            subject, payload = make(i)
            await nc.publish(subject, payload)
            if i % 1000 == 999:
                await nc.flush()
        await nc.flush()
        return (time.process_time() - started) / count
    finally:
        await nc.close()


def ingest_cpu(url: str, apply: bool, pods: int, count: int) -> float:
    """CPU seconds per message received by a subscriber process (applying or not)."""
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    parent, child = context.Pipe()
    process = context.Process(target=_subscriber, args=(url, apply, pods, ready, child))
    process.start()
    try:
        if not ready.wait(20):
            raise RuntimeError("subscriber did not start")
        members = endpoints(pods)
        payloads = [(SUBJECTS.metrics(POOL, e.name), encode(snapshot(e, 1))) for e in members]
        asyncio.run(publish_cpu(url, lambda i: payloads[i % pods], count))
        parent.send(count)
        if not parent.poll(20):
            raise RuntimeError("subscriber did not report")
        received, cpu = parent.recv()
        if received < count * 0.99:
            raise RuntimeError(f"subscriber received {received} of {count}")
        return cpu / received
    finally:
        process.join(10)


async def kv_costs(url: str | list[str], replicas: int, pods: int,
                   puts: int) -> tuple[float, float]:
    """(median latency, CPU per put) of ``kv.put`` of a ``pods``-endpoint set."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        kv = await js.create_key_value(bucket=f"bench-r{replicas}", replicas=replicas, history=1)
        value = encode(EndpointSet(pool=POOL, endpoints=tuple(endpoints(pods))))
        latencies = []
        started = time.process_time()
        for _ in range(puts):
            t0 = time.perf_counter()
            await kv.put(endpoints_key(POOL), value)
            latencies.append(time.perf_counter() - t0)
        return statistics.median(latencies), (time.process_time() - started) / puts
    finally:
        await nc.close()


def micro_costs(workdir: Path, pods: int, rounds: int) -> list[tuple[str, float, str, float]]:
    """Rows (what, µs, baseline, baseline µs): medians over ``rounds``."""
    server = NatsServer(workdir / "micro")
    server.start()
    try:
        members = endpoints(pods)
        snapshots = [snapshot(e, 1) for e in members]
        subjects = [SUBJECTS.metrics(POOL, e.name) for e in members]
        encoded = [encode(s) for s in snapshots]
        decision = msgspec.msgpack.encode({
            "pool": POOL, "pod": "pod-17", "address": "10.0.0.17:8000",
            "model": "tweet-summary-1", "criticality": "Standard", "picker": "picker-3",
            "time_ns": time.time_ns()})
        samples: dict[str, list[float]] = {}

        def measure(name: str, value: float) -> None:
            samples.setdefault(name, []).append(value * 1e6)

        for _ in range(rounds):
            measure("publish", asyncio.run(publish_cpu(
                server.url, lambda i: (subjects[i % pods], encode(snapshots[i % pods])),
                MESSAGES)))
            measure("publish-raw", asyncio.run(publish_cpu(
                server.url, lambda i: (subjects[i % pods], encoded[i % pods]), MESSAGES)))
            measure("ingest", ingest_cpu(server.url, True, pods, MESSAGES))
            measure("ingest-raw", ingest_cpu(server.url, False, pods, MESSAGES))
            measure("decision", asyncio.run(publish_cpu(
                server.url, lambda i: ("lig.decisions.scale", decision), MESSAGES)))
            measure("empty", asyncio.run(publish_cpu(
                server.url, lambda i: ("lig.decisions.scale", b""), MESSAGES)))
    finally:
        server.stop()
    kv = {}
    single = NatsServer(workdir / "kv1")
    single.start()
    try:
        kv[1] = asyncio.run(kv_costs(single.url, 1, pods, 200))
    finally:
        single.stop()
    cluster = NatsCluster(workdir / "kv3")
    cluster.start()
    try:
        asyncio.run(cluster.wait_ready())
        kv[3] = asyncio.run(kv_costs(cluster.url.split(","), 3, pods, 200))
    finally:
        cluster.stop()
    med = {name: statistics.median(values) for name, values in samples.items()}
    return [
        ("snapshot publish (encode + publish), CPU", med["publish"],
         "publish of pre-encoded bytes", med["publish-raw"]),
        (f"snapshot ingest (receive + decode + apply, {pods} pods), CPU", med["ingest"],
         "receive only (no-op callback)", med["ingest-raw"]),
        (f"decision event publish ({len(decision)} B), CPU", med["decision"],
         "empty publish", med["empty"]),
        (f"KV put of a {pods}-endpoint set ({len(encode(EndpointSet(POOL, tuple(members))))} B)"
         ", R3 latency", kv[3][0] * 1e6, "R1 latency", kv[1][0] * 1e6),
        ("KV put, R3 client CPU", kv[3][1] * 1e6, "R1 client CPU", kv[1][1] * 1e6),
    ]


# --- the fleet run --------------------------------------------------------------------------

def fleet_run(workdir: Path, pods: int, hz: float, window: float, windows: int,
              replicas: int | None) -> dict[str, float]:
    """Picker and NATS CPU with ``pods`` x ``hz`` snapshots/s flowing, and with the feed paused.

    ``replicas`` None: one server, no recording stream. Otherwise the recording stream exists
    with that many replicas (3: on a 3-node cluster), as the collector creates it.
    """
    servers: list[Any]
    if replicas is not None and replicas > 1:
        cluster = NatsCluster(workdir / "fleet-cluster")
        cluster.start()
        asyncio.run(cluster.wait_ready())
        servers, url, stop_servers = cluster.nodes, cluster.url, cluster.stop
    else:
        server = NatsServer(workdir / "fleet")
        server.start()
        servers, url, stop_servers = [server], server.url, server.stop
    if replicas is not None:
        asyncio.run(_create_recording(url, replicas))
    first = url.split(",")[0]
    feed = FleetFeed(first, POOL).start()
    context = multiprocessing.get_context("spawn")
    control = context.Event()
    counter = context.Value("q", 0)
    total_s = 10 + 2 * windows * (window + 1) + 10
    feeder = context.Process(target=_feed, args=(first, pods, hz, total_s, control, counter))
    picker = PickerProcess(POOL, url, workdir, stale_after=1.0, log_level="WARNING")

    def nats_cpu() -> float:
        return sum(cpu_seconds(node.pid) for node in servers)

    try:
        feed.set_pool()
        feed.set_endpoints({e.name: e.hostport for e in endpoints(pods)})
        control.set()
        feeder.start()
        picker.start().wait_ready(timeout=30)
        # Baseline: the same picker with every pod registered and no snapshots flowing, once it
        # has worked off anything still queued (its received count stands still).
        control.clear()
        _wait_drained(picker)
        idle_picker, idle_nats = [], []
        for _ in range(windows):
            p0, s0, t0 = cpu_seconds(picker.pid), nats_cpu(), time.monotonic()
            time.sleep(window)
            elapsed = time.monotonic() - t0
            idle_picker.append((cpu_seconds(picker.pid) - p0) / elapsed)
            idle_nats.append((nats_cpu() - s0) / elapsed)
        picker_idle, nats_idle = statistics.median(idle_picker), statistics.median(idle_nats)
        # Loaded: CPU per message the picker actually received, above the idle rate.
        control.set()
        time.sleep(2)  # the table fills, the rate settles
        rates, sent, picker_cores, nats_cores, picker_us, nats_us = [], [], [], [], [], []
        for _ in range(windows):
            p0, s0, r0, n0, t0 = (cpu_seconds(picker.pid), nats_cpu(), _received(picker),
                                  counter.value, time.monotonic())
            time.sleep(window)
            p1, s1, r1, n1, t1 = (cpu_seconds(picker.pid), nats_cpu(), _received(picker),
                                  counter.value, time.monotonic())
            elapsed, received = t1 - t0, max(1.0, r1 - r0)
            rates.append(received / elapsed)
            sent.append((n1 - n0) / elapsed)
            picker_cores.append((p1 - p0) / elapsed)
            nats_cores.append((s1 - s0) / elapsed)
            picker_us.append((p1 - p0 - picker_idle * elapsed) / received * 1e6)
            nats_us.append((s1 - s0 - nats_idle * elapsed) / received * 1e6)
        fresh = _fresh_pods(picker)
        return {
            "messages_per_s (sent by the feed)": statistics.median(sent),
            "messages_per_s (received by the picker)": statistics.median(rates),
            "picker_cores_loaded": statistics.median(picker_cores),
            "picker_cores_idle (baseline)": picker_idle,
            "picker_us_per_message": statistics.median(picker_us),
            "nats_cores_loaded (all nodes)": statistics.median(nats_cores),
            "nats_cores_idle (baseline)": nats_idle,
            "nats_us_per_message": statistics.median(nats_us),
            "fresh_pods_last_window": fresh,
            "slow_consumer_in_log": float("slow consumer" in picker.log().lower()),
        }
    finally:
        control.clear()
        picker.stop()
        feeder.terminate()
        feeder.join(5)
        feed.stop()
        stop_servers()


async def _create_recording(url: str, replicas: int) -> None:
    nc = await nats.connect(url.split(","))
    try:
        await ensure_stream(nc.jetstream(), SUBJECTS, RECORD_MAX_AGE_S, replicas)
    finally:
        await nc.close()


def _metric(picker: PickerProcess, prefix: str) -> float:
    # A generous timeout: a busy picker answers /metrics (1,000 pods' gauges) late.
    url = f"http://127.0.0.1:{picker.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=15) as response:
        page = response.read().decode()
    for line in page.splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return float("nan")


def _fresh_pods(picker: PickerProcess) -> float:
    return _metric(picker, 'lig_picker_pods{state="fresh"}')


def _received(picker: PickerProcess) -> float:
    return _metric(picker, "lig_picker_snapshots_received_total ")


def _wait_drained(picker: PickerProcess, within: float = 30.0) -> None:
    """Until the picker's received count stands still for a second (bounded)."""
    deadline = time.monotonic() + within
    last = _received(picker)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = _received(picker)
        if now == last:
            return
        last = now


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--hz", type=float, default=20.0)
    parser.add_argument("--window", type=float, default=2.0, help="seconds per CPU window")
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the micro costs")
    parser.add_argument("--record", type=int, default=None, metavar="REPLICAS",
                        help="also record the snapshots in the LIG_METRICS stream with this "
                             "many replicas (3 runs a 3-node cluster)")
    parser.add_argument("--skip-micro", action="store_true", help="only the fleet run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-nats-") as tmp:
        workdir = Path(tmp)
        if not args.skip_micro:
            print(f"per-message costs (medians over {args.rounds} rounds)")
            print(f"| {'what':<66} | {'µs':>8} | {'baseline':<30} | {'µs':>8} | ratio |")
            print(f"|{'-' * 68}|{'-' * 10}|{'-' * 32}|{'-' * 10}|-------|")
            for what, value, baseline, base in micro_costs(workdir, args.pods, args.rounds):
                print(f"| {what:<66} | {value:8.2f} | {baseline:<30} | {base:8.2f} | "
                      f"{value / base:5.2f} |", flush=True)
        result = fleet_run(workdir, args.pods, args.hz, args.window, args.windows, args.record)
    recording = "no recording" if args.record is None else f"recording R{args.record}"
    print(f"\nfleet: {args.pods} pods x {args.hz:g} Hz into one picker, {recording} "
          f"(medians over {args.windows} windows of {args.window:g} s)")
    for name, value in result.items():
        print(f"  {name}: {value:.3f}")
    idle = max(1e-9, result["picker_cores_idle (baseline)"])
    print(f"  picker CPU ratio loaded/idle: {result['picker_cores_loaded'] / idle:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
