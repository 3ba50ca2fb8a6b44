"""``lig record`` and ``lig replay`` on a real nats-server: the window, the pool filter and the
registry as of the window start; replay spacing, speed and time shift; SIGTERM; and the one-line
errors (exit 2) for newer, truncated, corrupt and foreign files."""

from __future__ import annotations

import asyncio
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest
from nats.js import JetStreamContext

from recording.fileformat import MAGIC, Entry, FileHeader, Kind, Writer, read_entries, read_header
from services.collector.recording import ensure_recording
from shared.schemas import Endpoint, EndpointSet, InferencePool, PodMetrics, decode, encode
from shared.subjects import Subjects, endpoints_key, pool_key
from tests.support.nats_server import NatsServer
from tests.support.nats_sync import subscribed, synced
from tests.support.ports import free_port
from tests.support.processes import die_with_parent
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(60)

SUBJECTS = Subjects()
SECOND = 1_000_000_000


def lig(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lig.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def snapshot(pool: str, pod: str, seq: int, scrape_time_ns: int, waiting: int = 0) -> bytes:
    return encode(PodMetrics(pool=pool, pod=pod, address=f"127.0.0.1:{8000 + seq}", seq=seq,
                             scrape_time_ns=scrape_time_ns, scrape_duration_s=0.001, ok=True,
                             waiting=waiting))


def endpoints(pool: str, *ports: int) -> bytes:
    return encode(EndpointSet(pool=pool, endpoints=tuple(
        Endpoint(f"pod-{port}", "127.0.0.1", port) for port in ports)))


async def recorded(js: JetStreamContext, counts: dict[str, int]) -> None:
    """Wait until each recording stream holds its count of messages (polling the server, not
    guessing how long storing takes)."""
    async def holds() -> dict[str, int]:
        return {name: (await js.stream_info(name)).state.messages for name in counts}

    deadline = time.monotonic() + 10
    while (held := await holds()) != counts:
        assert time.monotonic() < deadline, f"recorded {held}, expected {counts}"
        await asyncio.sleep(0.02)


def entries(path: Path) -> tuple[FileHeader, list[tuple[Kind, Entry]]]:
    with path.open("rb") as source:
        return read_header(source), list(read_entries(source))


async def test_export_holds_the_window_of_one_pool_and_its_registry_at_the_start(
        nats_server: NatsServer, tmp_path: Path) -> None:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    try:
        kv = await js.create_key_value(bucket=SUBJECTS.registry_bucket, history=5)
        # Written before the registry recording exists: known from the bucket alone.
        await kv.put(pool_key("a"), encode(InferencePool(name="a", target_port=8000)))
        await ensure_recording(js, SUBJECTS, 600.0)
        await kv.put(endpoints_key("a"), endpoints("a", 1))
        await kv.put(endpoints_key("b"), endpoints("b", 9))
        await nc.publish(SUBJECTS.metrics("a", "before"), snapshot("a", "before", 1, 1))
        # Stored before the window starts: the registry's writes reach their recording through
        # the server's sourcing, which lags.
        await recorded(js, {SUBJECTS.metrics_stream: 1, SUBJECTS.registry_stream: 3})
        start = time.time_ns()
        await kv.put(endpoints_key("a"), endpoints("a", 1, 2))
        for seq in range(3):
            await nc.publish(SUBJECTS.metrics("a", "pod-1"), snapshot("a", "pod-1", seq, seq))
            await nc.publish(SUBJECTS.metrics("b", "pod-9"), snapshot("b", "pod-9", seq, seq))
            await nc.publish(SUBJECTS.decisions("a"), b"opaque %d" % seq)
            await nc.publish(SUBJECTS.decisions("b"), b"other %d" % seq)
            await nc.publish(SUBJECTS.records("a"), b"record %d" % seq)
            await nc.publish(SUBJECTS.records("b"), b"other record %d" % seq)
        await recorded(js, {SUBJECTS.metrics_stream: 7, SUBJECTS.decisions_stream: 12,
                            SUBJECTS.registry_stream: 4})
        await kv.delete(endpoints_key("a"))  # the last entry, in time order too
        await recorded(js, {SUBJECTS.registry_stream: 5})
    finally:
        await nc.close()

    out = tmp_path / "a.ligrec"
    result = await asyncio.to_thread(lig, "record", "--out", str(out), "--from", str(start / 1e9),
                                     "--pool", "a", "--nats-url", nats_server.url)
    assert result.returncode == 0, result.stderr
    header, found = entries(out)
    assert (header.pool, header.prefix) == ("a", "lig")
    assert abs(header.from_ns - start) < 1000

    def of(*kinds: Kind) -> list[tuple[Kind, str, bytes | None]]:
        return [(kind, entry.name, entry.data) for kind, entry in found if kind in kinds]

    assert of(Kind.REGISTRY_STATE, Kind.REGISTRY_CHANGE) == [
        (Kind.REGISTRY_STATE, pool_key("a"), encode(InferencePool(name="a", target_port=8000))),
        (Kind.REGISTRY_STATE, endpoints_key("a"), endpoints("a", 1)),
        (Kind.REGISTRY_CHANGE, endpoints_key("a"), endpoints("a", 1, 2)),
        (Kind.REGISTRY_CHANGE, endpoints_key("a"), None),
    ]
    assert of(Kind.SNAPSHOT) == [
        (Kind.SNAPSHOT, "metrics.a.pod-1", snapshot("a", "pod-1", seq, seq)) for seq in range(3)]
    assert of(Kind.DECISION) == [
        frame for seq in range(3) for frame in ((Kind.DECISION, "decisions.a", b"opaque %d" % seq),
                                                (Kind.DECISION, "records.a", b"record %d" % seq))]
    # One time order: the state first, the delete (written last) at the end.
    assert found[2][0] == Kind.REGISTRY_CHANGE and found[-1][0] == Kind.REGISTRY_CHANGE
    times = [entry.time_ns for kind, entry in found if kind != Kind.REGISTRY_STATE]
    assert times == sorted(times) and times[0] > start

    # Without --pool: every pool's decisions and records.
    every = tmp_path / "all.ligrec"
    result = await asyncio.to_thread(lig, "record", "--out", str(every), "--from",
                                     str(start / 1e9), "--nats-url", nats_server.url)
    assert result.returncode == 0, result.stderr
    assert sorted(entry.name for kind, entry in entries(every)[1] if kind == Kind.DECISION) == [
        name for name in ("decisions.a", "decisions.b", "records.a", "records.b")
        for _ in range(3)]

    # A window in the future holds no message but the registry as it is then (endpoints.a was
    # deleted) and is still a valid file.
    later = tmp_path / "empty.ligrec"
    result = await asyncio.to_thread(lig, "record", "--out", str(later), "--from",
                                     str(time.time() + 60), "--to", str(time.time() + 90),
                                     "--nats-url", nats_server.url)
    assert result.returncode == 0, result.stderr
    assert sorted((kind, entry.name) for kind, entry in entries(later)[1]) == [
        (Kind.REGISTRY_STATE, endpoints_key("b")), (Kind.REGISTRY_STATE, pool_key("a"))]


def write_recording(path: Path, from_ns: int, snapshot_times_s: list[float]) -> None:
    """A recording of one pool: its registry, then one snapshot of pod-1 at each given second
    after ``from_ns``."""
    with path.open("wb") as out:
        writer = Writer(out, FileHeader(time.time_ns(), from_ns, from_ns + 100 * SECOND, "lig"))
        writer.add(Kind.REGISTRY_STATE, Entry(from_ns - SECOND, pool_key("p"),
                                              encode(InferencePool(name="p", target_port=8000))))
        writer.add(Kind.REGISTRY_STATE, Entry(from_ns - SECOND, endpoints_key("p"),
                                              endpoints("p", 1)))
        writer.add(Kind.DECISION, Entry(from_ns, "decisions.p", b"never published"))
        for seq, at in enumerate(snapshot_times_s):
            at_ns = from_ns + int(at * SECOND)
            writer.add(Kind.SNAPSHOT, Entry(at_ns, "metrics.p.pod-1",
                                            snapshot("p", "pod-1", seq, at_ns, waiting=seq)))
        writer.close()


def start_replay(path: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "lig.cli", "replay", str(path), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=die_with_parent)


async def test_replay_keeps_the_spacing_scaled_by_speed_with_times_shifted_to_now(
        nats_server: NatsServer, tmp_path: Path) -> None:
    recorded_at = time.time_ns() - 3600 * SECOND  # an hour ago
    path = tmp_path / "r.ligrec"
    write_recording(path, recorded_at, [1.0, 3.0, 5.0])
    nc = await nats.connect(nats_server.url)
    heard: list[tuple[float, PodMetrics]] = []

    async def keep(message) -> None:  # type: ignore[no-untyped-def]
        heard.append((time.monotonic(), decode(message.data, PodMetrics)))

    decisions: list[bytes] = []

    async def keep_decision(message) -> None:  # type: ignore[no-untyped-def]
        decisions.append(message.data)

    try:
        await nc.subscribe("replayed.metrics.>", cb=keep)
        await nc.subscribe("replayed.decisions.>", cb=keep_decision)
        await synced(nc)
        started_ns = time.time_ns()
        result = await asyncio.to_thread(
            lambda: subprocess.run([sys.executable, "-m", "lig.cli", "replay", str(path),
                                    "--nats-url", nats_server.url, "--prefix", "replayed",
                                    "--speed", "2"], capture_output=True, text=True, timeout=30))
        assert result.returncode == 0, result.stderr
        assert "3 snapshots, 2 registry writes" in result.stdout, result.stdout
        await eventually(lambda: len(heard) == 3, within=2, what="three snapshots")
        kv = await nc.jetstream().key_value("replayed-registry")
        assert (await kv.get(endpoints_key("p"))).value == endpoints("p", 1)
    finally:
        await nc.close()
    # 2 s recorded apart, at speed 2: 2 s from the first to the third, where speed 1 takes 4 s
    # and no pacing none. Judged on the span, not each gap: a message the loaded machine
    # delivers late shortens the next gap (the replay keeps to its schedule).
    span = heard[-1][0] - heard[0][0]
    assert 1.5 < span < 3.5, [arrived for arrived, _ in heard]
    for _, replayed in heard:  # recorded an hour ago, replayed as fresh
        assert abs(replayed.scrape_time_ns - started_ns) < 10 * SECOND
    assert [replayed.waiting for _, replayed in heard] == [0, 1, 2]
    assert decisions == []


async def test_sigterm_stops_a_replay_at_once(nats_server: NatsServer, tmp_path: Path) -> None:
    path = tmp_path / "long.ligrec"
    write_recording(path, time.time_ns(), [0.0, 60.0])
    nc = await nats.connect(nats_server.url)
    heard: list[bytes] = []

    async def keep(message) -> None:  # type: ignore[no-untyped-def]
        heard.append(message.data)

    try:
        await subscribed(nc, "lig.metrics.>", cb=keep)
        replay = start_replay(path, "--nats-url", nats_server.url)
        try:
            await eventually(lambda: len(heard) == 1, within=20, what="the first snapshot")
            sent = time.monotonic()
            replay.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(replay.wait, 10)
            elapsed = time.monotonic() - sent
        finally:
            if replay.poll() is None:
                replay.kill()
        assert code == 0 and elapsed < 2.0, (code, elapsed)
        assert "lig replay: stopped: 1 snapshots" in replay.stdout.read()  # type: ignore[union-attr]
    finally:
        await nc.close()


def _bad_files(tmp_path: Path) -> dict[str, bytes]:
    good = tmp_path / "good.ligrec"
    write_recording(good, time.time_ns(), [0.0])
    data = good.read_bytes()
    header_end = len(MAGIC) + 6 + struct.unpack(">I", data[len(MAGIC) + 2:len(MAGIC) + 6])[0]
    corrupt = bytearray(data)
    corrupt[header_end + 12] ^= 0x5A  # inside the compressed body
    return {
        "newer": MAGIC + struct.pack(">HI", 99, 0),
        "truncated": data[:-7],
        "corrupt": bytes(corrupt),
        "foreign": b"PK\x03\x04 not a recording",
        "header cut": data[:len(MAGIC) + 4],
    }


@pytest.mark.parametrize("kind", ["newer", "truncated", "corrupt", "foreign", "header cut"])
def test_bad_files_give_one_line_and_exit_2(kind: str, nats_server: NatsServer,
                                            tmp_path: Path) -> None:
    path = tmp_path / f"{kind}.ligrec"
    path.write_bytes(_bad_files(tmp_path)[kind])
    result = lig("replay", str(path), "--nats-url", nats_server.url, "--speed", "1000")
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lig replay: error: {path}: "), result.stderr
    expected = {"newer": "format version 99 is newer", "truncated": "truncated",
                "corrupt": "corrupt", "foreign": "not a lig recording",
                "header cut": "truncated"}[kind]
    assert expected in lines[0], lines[0]


def test_record_without_a_nats_says_so_in_one_line_and_exits_1(tmp_path: Path) -> None:
    result = lig("record", "--out", str(tmp_path / "r.ligrec"), "--nats-url",
                 f"nats://127.0.0.1:{free_port()}")
    assert result.returncode == 1, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot connect to NATS at nats://127.0.0.1:" in lines[0], lines
    assert not list(tmp_path.iterdir())  # no file, no partial file
