"""The recorder with the real stack: record a running ``lig up`` under traffic, export it with
``lig record``, replay it with ``lig replay`` into a fresh nats-server where only a picker runs
(no simulators, no collector, no registry): the picker becomes ready and routes on the replayed
metrics, and ``lig status`` sees the recorded pods as fresh. And as a new user records: the
default ten-minute window over a stack up for seconds, replayed at once (saying it skips the
window's empty start) with progress on stderr, its pods fresh in ``lig status`` and no picker
of the local stack listed as the replayed fleet's."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.msg import Msg
from prometheus_client.parser import text_string_to_metric_families

from recording.fileformat import Kind, read_entries, read_header
from shared.schemas import EndpointSet, PodMetrics, decode
from shared.subjects import endpoints_key
from tests.support.ext_proc_client import route
from tests.support.lig_up import SCRAPE_INTERVAL_S, STALE_AFTER_S, STATUS_STALE_AFTER, lig_up
from tests.support.nats_server import NatsServer
from tests.support.nats_sync import subscribed
from tests.support.picker import PickerProcess
from tests.support.processes import die_with_parent
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(240)

BASE = "meta-llama/Llama-3.1-8B-Instruct"
REQUESTS = 24
# The window exported: the replay must outlast the picker's readiness, its requests and a `lig
# status` (the picker is started and connected beforehand, so that is a few seconds).
RECORD_S = 10


def lig(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``lig ARGS`` to completion."""
    return subprocess.run([sys.executable, "-m", "lig.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def start_replay(path: Path, nats_url: str, *args: str, stderr: int = subprocess.STDOUT
                 ) -> subprocess.Popen[str]:
    """``lig replay PATH --nats-url NATS_URL ARGS`` in the background, output piped (stderr
    into stdout unless ``stderr`` says otherwise)."""
    return subprocess.Popen(
        [sys.executable, "-m", "lig.cli", "replay", str(path), "--nats-url", nats_url, *args],
        stdout=subprocess.PIPE, stderr=stderr, text=True, preexec_fn=die_with_parent)


def metric(page: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples with ``labels`` on a Prometheus page."""
    return sum(sample.value for family in text_string_to_metric_families(page)
               for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v
                                              for k, v in labels.items()))


def connected(picker: PickerProcess) -> bool:
    """Whether ``picker`` says it is connected to NATS (its subscriptions go out with it)."""
    try:
        return metric(picker.metrics(), "lig_picker_nats_connected") == 1
    except OSError:  # its metrics server is not up yet
        return False


def recorded_addresses(path: Path, pool: str) -> tuple[set[str], int]:
    """Every address the recording's registry gives ``pool``'s pods, and its snapshot count."""
    addresses: set[str] = set()
    snapshots = 0
    with path.open("rb") as source:
        read_header(source)
        for kind, entry in read_entries(source):
            if kind == Kind.SNAPSHOT:
                snapshots += 1
            elif entry.name == endpoints_key(pool) and entry.data is not None:
                endpoints = decode(entry.data, EndpointSet).endpoints
                addresses |= {f"{e.address}:{e.port}" for e in endpoints}
    return addresses, snapshots


async def test_a_recorded_stack_replayed_into_a_fresh_nats_drives_a_picker(
        tmp_path: Path, nats_server: NatsServer,
        picker_process: Callable[..., PickerProcess]) -> None:
    out = tmp_path / "fleet.ligrec"
    with lig_up(tmp_path / "state", "--pods", "2", "--pickers", "1") as stack:
        info = stack.info
        started = time.monotonic()
        # Waiting on the fresh NATS meanwhile, which nothing else will ever write to.
        # Stale after 3 s, for the picker and `lig status` alike (lig_up's test timing): a
        # replayed snapshot's age is its recorded lag plus how late a loaded machine publishes
        # and reads it. (Unshifted, the recorded scrape times would be over 10 s old: stale all
        # the same.)
        picker = picker_process(info.pool, nats_server.url, stale_after=STALE_AFTER_S)
        async with httpx.AsyncClient(timeout=30) as client:
            for i in range(REQUESTS):
                response = await client.post(f"{stack.gateway}/v1/completions", json={
                    "model": BASE, "prompt": f"request {i}", "max_tokens": 4})
                assert response.status_code == 200, response.text
        # Keep the stack (and its recording) running until the window is covered.
        await asyncio.sleep(max(0.0, RECORD_S - (time.monotonic() - started)))
        exported = await asyncio.to_thread(
            lig, "record", "--out", str(out), "--since", f"{RECORD_S}s",
            "--nats-url", info.nats_url, "--prefix", info.prefix)
        assert exported.returncode == 0, exported.stdout + exported.stderr
    assert "snapshot" in exported.stdout, exported.stdout
    addresses, snapshots = recorded_addresses(out, info.pool)
    # Every scrape is recorded: half of those the window holds is plenty to tell.
    assert len(addresses) == 2 and snapshots >= RECORD_S / SCRAPE_INTERVAL_S, \
        (addresses, snapshots)

    # The stack is gone: from here on the only source of registry and metrics is the file.
    await eventually(lambda: connected(picker), within=30, what="the picker on the fresh NATS")
    replay = start_replay(out, nats_server.url, "--prefix", info.prefix)
    try:
        await asyncio.to_thread(picker.wait_ready, 60)
        before = picker.metrics()
        picks = [await route(picker.grpc_port, json.dumps({"model": BASE, "prompt": "x"}).encode())
                 for _ in range(10)]
        after = picker.metrics()
        assert replay.poll() is None, "the replay ended before the picker was asked"
        status = await asyncio.to_thread(
            lig, "status", "--nats-url", nats_server.url, "--prefix", info.prefix,
            "--state-dir", str(tmp_path / "no-stack"), *STATUS_STALE_AFTER)
    finally:
        replay.send_signal(signal.SIGTERM)
        output, _ = replay.communicate(timeout=10)
    assert {pick.destination for pick in picks} <= addresses, picks
    assert all(pick.status is None for pick in picks), picks
    # Routed on fresh replayed snapshots, not the uniform fallback for stale pods.
    assert metric(after, "lig_picker_all_stale_decisions_total") == \
        metric(before, "lig_picker_all_stale_decisions_total")
    assert metric(after, "lig_picker_snapshots_received_total") > 0
    assert "2 pods, 2 fresh" in status.stdout, status.stdout + status.stderr
    assert replay.returncode == 0, output
    assert "lig replay: stopped" in output, output


# A recording made as a new user makes one: the stack ran for seconds, the window is the default
# ten minutes. Replayed at a quarter speed, so that it outlasts a `lig status` on a loaded
# machine (10 s recorded: 40 s of replay, stopped once checked).
LONG_SINCE = "10m"
SLOW = 0.25
# A pod's replayed snapshots come SPACING_S apart (the test stacks' scrape interval, slowed):
# `lig status` listens that long and more, and judges them stale after two spacings.
SPACING_S = SCRAPE_INTERVAL_S / SLOW


def published_records(path: Path) -> int:
    """How many records replaying ``path`` publishes: registry writes and snapshots."""
    with path.open("rb") as source:
        read_header(source)
        return sum(kind != Kind.DECISION for kind, _ in read_entries(source))


async def test_a_window_longer_than_the_recording_replays_at_once_with_progress_and_fresh_pods(
        tmp_path: Path, nats_server: NatsServer) -> None:
    out = tmp_path / "fleet.ligrec"
    state = tmp_path / "state"
    with lig_up(state, "--pods", "2", "--pickers", "1") as stack:
        info = stack.info
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=30) as client:
            for i in range(4):
                response = await client.post(f"{stack.gateway}/v1/completions", json={
                    "model": BASE, "prompt": f"request {i}", "max_tokens": 4})
                assert response.status_code == 200, response.text
        # Keep the stack (and its recording) running until RECORD_S are recorded.
        await asyncio.sleep(max(0.0, RECORD_S - (time.monotonic() - started)))
        exported = await asyncio.to_thread(
            lig, "record", "--out", str(out), "--since", LONG_SINCE,
            "--nats-url", info.nats_url, "--prefix", info.prefix)
        assert exported.returncode == 0, exported.stdout + exported.stderr
        total = published_records(out)

        # The fresh NATS: count what the replay publishes, and how far its scrape times are
        # from the moment they arrive.
        nc = await nats.connect(nats_server.url)
        offsets_s: list[float] = []

        async def heard(message: Msg) -> None:
            snapshot = decode(message.data, PodMetrics)
            offsets_s.append((time.time_ns() - snapshot.scrape_time_ns) / 1e9)

        try:
            await subscribed(nc, f"{info.prefix}.metrics.>", cb=heard)
            replay = start_replay(out, nats_server.url, "--prefix", info.prefix,
                                  "--speed", str(SLOW), "--progress", "1",
                                  stderr=subprocess.PIPE)
            try:
                # Honouring the window's empty start would publish nothing for over 9 minutes
                # (36 at this speed): snapshots within a minute are the replay starting at once.
                await eventually(lambda: len(offsets_s) >= 6, within=60,
                                 what="snapshots from the replay's start")
                # Read through the NATS only: the running stack's state folder is given, and
                # its pickers (on the stack's NATS) must not be listed as this fleet's. Stale
                # after two spacings: the point is that replayed snapshots are dated now, not
                # ten minutes off.
                status = await asyncio.to_thread(
                    lig, "status", "--nats-url", nats_server.url, "--prefix", info.prefix,
                    "--state-dir", str(state), "--stale-after", str(2 * SPACING_S),
                    "--window", str(SPACING_S + 1), "--json")
                assert replay.poll() is None, "the replay ended before lig status read it"
            finally:
                replay.send_signal(signal.SIGTERM)
                stdout, stderr = await asyncio.to_thread(replay.communicate, timeout=10)
        finally:
            await nc.close()

    assert replay.returncode == 0, stdout + stderr
    # Dated on the replay's clock: not the recorded times, nor ten minutes ahead of them.
    assert all(-1.0 < offset < 60.0 for offset in offsets_s), offsets_s

    assert status.returncode == 0, status.stdout + status.stderr
    report = json.loads(status.stdout)
    assert [pod["state"] for pod in report["pods"]] == ["fresh", "fresh"], report["pods"]
    assert report["pickers"] == [], report["pickers"]
    assert f"they use NATS {info.nats_url}" in report["pickers_left_out"], report

    lines = stderr.splitlines()
    lead_in = re.fullmatch(r"lig replay: the window starts (\d+)m(\d\d)s before the first "
                           r"record: starting at the first record", lines[0])
    assert lead_in is not None, stderr
    assert int(lead_in[1]) >= 8, lines[0]  # 10 minutes less the stack's start and its run
    progress = [re.fullmatch(r"lig replay: (\d+)/(\d+) records published \(\d+%\), at \S+ of "
                             r"\S+ recorded", line) for line in lines[1:]]
    assert progress and all(progress), stderr
    assert {int(match[2]) for match in progress if match} == {total}
    published = [int(match[1]) for match in progress if match]
    assert published == sorted(published) and 0 < published[-1] < total, published
    # stdout holds only the summary.
    assert stdout.splitlines() == [stdout.strip()] and stdout.startswith("lig replay: stopped:")
