"""Least privilege on a real nats-server configured with what ``lig nats-config`` writes: each
service's credentials can do its job and nothing that would let it steer traffic."""

from __future__ import annotations

import asyncio
import contextlib
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from lig.nats_config import write_config
from lig.server_binaries import server_binary
from recording.fileformat import Entry, FileHeader, Kind, Writer
from services.kvevents.recording import stream_config
from services.picker.kv_blocks_feed import KVBlocksSink
from services.picker.kv_blocks_feed import subscribe as subscribe_kv_blocks
from services.registry.files import FileSnapshot, SourceFile, load
from services.registry.publisher import Publisher, read_bucket
from shared.recording import ensure_stream
from shared.schemas import PodMetrics, encode
from shared.subjects import Subjects
from tests.support.nats_server import NatsServer
from tests.support.nats_sync import subscribed, synced
from tests.support.picker import PickerProcess
from tests.support.processes import die_with_parent
from tests.support.registry_yaml import dump, model, pool
from tests.support.simulator import SimulatedPods
from tests.support.waiting import eventually

SUBJECTS = Subjects()
REPLAY = Subjects("lig-replay")
SERVICES = ("registry", "collector", "kv-events", "picker", "status", "replay")
# JetStream request timeout where a denied request is expected: it gets no answer, but is not
# waited out (the server's violation report ends the wait, see refused()).
DENIED_S = 30.0
KV_PUT = f"$KV.{SUBJECTS.registry_bucket}.endpoints.pool-a"
REGISTRY_STREAM = f"KV_{SUBJECTS.registry_bucket}"


class SecuredNats:
    """A nats-server with the generated authorization, and the services' credentials."""

    def __init__(self, server: NatsServer, config_dir: Path) -> None:
        self.server = server
        self.config_dir = config_dir

    @property
    def url(self) -> str:
        return self.server.url

    def credentials(self, service: str) -> dict[str, str]:
        lines = (self.config_dir / f"{service}.env").read_text().splitlines()
        return dict(line.split("=", 1) for line in lines if line)

    def flags(self, service: str) -> list[str]:
        creds = self.credentials(service)
        # "=": a random password may start with "-", which argparse would take for a flag.
        return ["--nats-user", creds["LIG_NATS_USER"],
                f"--nats-password={creds['LIG_NATS_PASSWORD']}"]

    async def connect(self, service: str, errors: list[str] | None = None) -> Client:
        """A connection as ``service``; server errors (permission violations) go to ``errors``."""
        creds = self.credentials(service)

        async def error_cb(exc: Exception) -> None:
            if errors is not None:
                errors.append(str(exc))

        return await nats.connect(self.url, user=creds["LIG_NATS_USER"],
                                  password=creds["LIG_NATS_PASSWORD"], error_cb=error_cb,
                                  allow_reconnect=False)


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[SecuredNats]:
    config_dir = tmp_path / "nats-config"
    write_config(config_dir, SUBJECTS, REPLAY)
    server_conf = config_dir / "server.conf"
    server_conf.write_text("include auth.conf\n")
    server = NatsServer(tmp_path / "js", extra_args=("-c", str(server_conf)))
    server.start()
    try:
        yield SecuredNats(server, config_dir)
    finally:
        server.stop()


def snapshot(pod: str = "pod-0", address: str = "10.0.0.1:8000") -> PodMetrics:
    return PodMetrics(pool="pool-a", pod=pod, address=address, seq=1,
                      scrape_time_ns=time.time_ns(), scrape_duration_s=0.001, ok=True)


REGISTRY_TEXT = dump(pool(), model())


async def publish_registry(secured: SecuredNats) -> None:
    nc = await secured.connect("registry")
    try:
        await Publisher(nc.jetstream(), SUBJECTS.registry_bucket).publish(
            load(FileSnapshot((SourceFile("r.yaml", REGISTRY_TEXT),))))
    finally:
        await nc.close()


def violated(errors: list[str], subject: str) -> bool:
    """Whether the server reported a publish to ``subject`` as a permission violation."""
    return f'permissions violation for publish to "{subject.lower()}"' in "\n".join(
        error.lower() for error in errors)


async def heard(secured: SecuredNats, subject: str, sender: Client, publish_to: str,
                payload: bytes) -> list[bytes]:
    """What the status user (allowed to read every snapshot) hears on ``subject`` when
    ``sender`` publishes ``payload`` on ``publish_to``.

    No waiting: once the listener's subscription is synced, then the sender's publish, the
    server has routed the message, and once the listener is synced again it has read what was
    routed to it (the PONG comes after it on the same connection).
    """
    listener = await secured.connect("status")
    try:
        subscription = await subscribed(listener, subject)
        await sender.publish(publish_to, payload)
        await synced(sender)
        await synced(listener)
        return [(await subscription.next_msg(timeout=1)).data
                for _ in range(subscription.pending_msgs)]
    finally:
        await listener.close()


async def unheard(secured: SecuredNats, subject: str, sender: Client, sender_errors: list[str],
                  publish_to: str, payload: bytes) -> None:
    """``sender`` may not publish on ``publish_to``: the server says so, and nobody hears it.

    The violation report is what proves the refusal (a "nothing arrived" alone also passes when
    the listener was not yet subscribed); it is read before the sender's PONG.
    """
    assert await heard(secured, subject, sender, publish_to, payload) == []
    assert violated(sender_errors, publish_to), sender_errors


async def refused(errors: list[str], subject: str, request: Awaitable[object]) -> None:
    """A JetStream request the server must refuse: the server reports the publish to ``subject``
    (the API or KV subject) as a violation. A refused request is never answered, so it is not
    waited out: the report ends the wait, and the request is cancelled."""
    task = asyncio.ensure_future(request)
    try:
        await eventually(lambda: violated(errors, subject) or task.done(), within=10,
                         what=f"a permission violation for {subject}")
        assert not task.done() or task.exception() is not None, f"{subject} was allowed"
        assert violated(errors, subject), errors
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, nats.errors.Error, TimeoutError):
            await task


async def recorded_messages(nc: Client, stream: str = SUBJECTS.metrics_stream) -> int:
    """Messages in a recording stream (0 while it does not exist or does not answer)."""
    try:
        return (await nc.jetstream(timeout=2).stream_info(stream)).state.messages
    except (nats.errors.Error, TimeoutError):
        return 0


def start_service(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """``lig ARGV`` logging into ``log_path``."""
    with log_path.open("wb") as log:
        return subprocess.Popen([sys.executable, "-m", "lig.cli", *argv], stdout=log,
                                stderr=subprocess.STDOUT, preexec_fn=die_with_parent)


def status_until_fresh(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``lig status ARGV``, asked again for up to 10 s until every pod is fresh (exit 0): on this
    busy machine a scrape may time out and show its pod as failing until the next one."""
    deadline = time.monotonic() + 10
    while True:
        result = subprocess.run([sys.executable, "-m", "lig.cli", "status", *argv],
                                capture_output=True, text=True, timeout=30)
        if result.returncode == 0 or time.monotonic() > deadline:
            return result


def test_generated_config_is_valid_and_private(tmp_path: Path) -> None:
    users = write_config(tmp_path, SUBJECTS, REPLAY)
    assert [user.user for user in users] == [f"lig-{name}" for name in SERVICES]
    assert len({user.password for user in users}) == len(users)
    for name in ("auth.conf", *(f"{service}.env" for service in SERVICES)):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    (tmp_path / "server.conf").write_text("include auth.conf\n")
    checked = subprocess.run(
        [server_binary("nats-server"), "-t", "-c", str(tmp_path / "server.conf")],
        capture_output=True, text=True, timeout=10)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # Running it again keeps the passwords (the server and the services stay in step).
    again = write_config(tmp_path, SUBJECTS, REPLAY)
    assert [u.password for u in again] == [u.password for u in users]


def test_command_writes_the_files(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lig.cli", "nats-config", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "auth.conf").exists() and "include auth.conf" in result.stdout
    same = subprocess.run(
        [sys.executable, "-m", "lig.cli", "nats-config", "--out", str(tmp_path / "x"),
         "--replay-prefix", "lig"], capture_output=True, text=True, timeout=30)
    assert same.returncode == 2
    (tmp_path / "a-file").write_text("")
    blocked = subprocess.run(
        [sys.executable, "-m", "lig.cli", "nats-config", "--out", str(tmp_path / "a-file")],
        capture_output=True, text=True, timeout=30)
    assert blocked.returncode == 2 and "cannot write into" in blocked.stderr, blocked.stderr


async def test_a_picker_cannot_publish_a_snapshot_or_write_the_registry(
    secured: SecuredNats,
) -> None:
    await publish_registry(secured)
    errors: list[str] = []
    picker = await secured.connect("picker", errors)
    try:
        await unheard(secured, SUBJECTS.all_metrics(), picker, errors,
                      SUBJECTS.metrics("pool-a", "pod-0"), encode(snapshot()))

        kv = await picker.jetstream(timeout=DENIED_S).key_value(SUBJECTS.registry_bucket)
        before = (await kv.get("endpoints.pool-a")).value
        await refused(errors, KV_PUT, kv.put("endpoints.pool-a", b"poisoned"))
        await refused(errors, f"$JS.API.STREAM.DELETE.{REGISTRY_STREAM}",
                      picker.jetstream(timeout=DENIED_S).delete_key_value(
                          SUBJECTS.registry_bucket))
        assert (await kv.get("endpoints.pool-a")).value == before

        # What a picker may do: read the registry, hear snapshots, publish decisions and
        # decision records.
        assert sorted(await read_bucket(picker.jetstream(), SUBJECTS.registry_bucket)) == [
            "endpoints.pool-a", "model.pool-a.model-a", "pool.pool-a"]
        await picker.subscribe("lig.decisions.>")
        await picker.publish("lig.decisions.pool-a", b"x")
        # The status user (lig status, lig record) may follow the records live.
        assert await heard(secured, SUBJECTS.all_records(), picker, SUBJECTS.records("pool-a"),
                           b"record") == [b"record"]
    finally:
        await picker.close()
    assert all("decisions" not in e and "records" not in e for e in errors), errors


async def test_a_collector_cannot_write_the_registry(secured: SecuredNats) -> None:
    await publish_registry(secured)
    errors: list[str] = []
    collector = await secured.connect("collector", errors)
    try:
        kv = await collector.jetstream(timeout=DENIED_S).key_value(SUBJECTS.registry_bucket)
        await refused(errors, KV_PUT, kv.put("endpoints.pool-a", b"poisoned"))
        config = (await collector.jetstream().stream_info(REGISTRY_STREAM)).config
        await refused(errors, f"$JS.API.STREAM.UPDATE.{REGISTRY_STREAM}",
                      collector.jetstream(timeout=DENIED_S).update_stream(config))
        # It may publish snapshots (that is its job).
        got = await heard(secured, SUBJECTS.all_metrics(), collector,
                          SUBJECTS.metrics("pool-a", "pod-0"), encode(snapshot()))
        assert len(got) == 1
    finally:
        await collector.close()


async def test_kv_events_publishes_block_changes_and_records_them_only(
    secured: SecuredNats,
) -> None:
    await publish_registry(secured)
    errors: list[str] = []
    kv_events = await secured.connect("kv-events", errors)
    picker_errors: list[str] = []
    picker = await secured.connect("picker", picker_errors)
    try:
        # Its job: publish block changes, which pickers hear, and manage their stream.
        subject = SUBJECTS.kv_blocks("pool-a", "pod-0")
        got = await heard(secured, SUBJECTS.all_kv_blocks(), kv_events, subject, b"changes")
        assert len(got) == 1
        by_picker = await subscribed(picker, SUBJECTS.all_kv_blocks())
        await kv_events.publish(subject, b"again")
        await synced(kv_events)
        assert (await by_picker.next_msg(timeout=5)).data == b"again"
        wanted = stream_config(SUBJECTS, 60.0, 1 << 20)
        assert await ensure_stream(kv_events.jetstream(), wanted) == "created"
        # A picker reads the recording (its precise index's history), and cannot remove it.
        await kv_events.publish(subject, b"recorded")
        await kv_events.flush()
        skipped: list[str] = []
        sink = KVBlocksSink(lambda pool: None, on_skip=skipped.append)
        await subscribe_kv_blocks(picker, SUBJECTS, sink, ["pool-a"], history=True)
        await eventually(lambda: skipped == ["undecodable"], within=5,
                         what="the picker reads the recorded (undecodable) message")
        await refused(picker_errors, f"$JS.API.STREAM.DELETE.{SUBJECTS.kv_blocks_stream}",
                      picker.jetstream(timeout=DENIED_S).delete_stream(
                          SUBJECTS.kv_blocks_stream))
        # Not its job: snapshots, the registry, the pickers' block changes stream from a picker.
        await unheard(secured, SUBJECTS.all_metrics(), kv_events, errors,
                      SUBJECTS.metrics("pool-a", "pod-0"), encode(snapshot()))
        kv = await kv_events.jetstream(timeout=DENIED_S).key_value(SUBJECTS.registry_bucket)
        await refused(errors, KV_PUT, kv.put("endpoints.pool-a", b"poisoned"))
        await unheard(secured, SUBJECTS.all_kv_blocks(), picker, picker_errors, subject,
                      b"forged")
    finally:
        await kv_events.close()
        await picker.close()


async def test_kv_events_replicas_hear_each_others_heartbeats_but_not_the_collectors(
    secured: SecuredNats,
) -> None:
    errors: list[str] = []
    one, other = (await secured.connect("kv-events", errors),
                  await secured.connect("kv-events", errors))
    collector = await secured.connect("collector", [])
    try:
        heartbeats = await subscribed(one, SUBJECTS.all_kv_events_heartbeats())
        collectors = await subscribed(collector, SUBJECTS.all_collector_heartbeats())
        await other.publish(SUBJECTS.kv_events_heartbeat("kv-b"), b"beat")
        await synced(other)
        assert (await heartbeats.next_msg(timeout=5)).subject == \
            SUBJECTS.kv_events_heartbeat("kv-b")
        # A kv-events replica cannot pose as a collector (it would take scrapes over): the
        # server refuses the publish before the PONG of the sync, so nothing can follow it.
        await other.publish(SUBJECTS.collector_heartbeat("kv-b"), b"beat")
        await synced(other)
        await synced(collector)
        assert violated(errors, SUBJECTS.collector_heartbeat("kv-b")), errors
        assert collectors.delivered == 0
    finally:
        await one.close()
        await other.close()
        await collector.close()
    assert not [e for e in errors if "kvevents" in e.lower()], errors


async def test_status_reads_only_and_replay_writes_only_under_its_prefix(
    secured: SecuredNats,
) -> None:
    await publish_registry(secured)
    status_errors: list[str] = []
    replay_errors: list[str] = []
    status = await secured.connect("status", status_errors)
    replay = await secured.connect("replay", replay_errors)
    try:
        assert await read_bucket(status.jetstream(), SUBJECTS.registry_bucket)
        kv = await status.jetstream(timeout=DENIED_S).key_value(SUBJECTS.registry_bucket)
        await refused(status_errors, f"$KV.{SUBJECTS.registry_bucket}.pool.pool-a",
                      kv.put("pool.pool-a", b"x"))
        await unheard(secured, SUBJECTS.all_metrics(), status, status_errors,
                      SUBJECTS.metrics("pool-a", "pod-0"), encode(snapshot()))

        # Replay: a bucket and snapshots of its own, nothing under the production prefix.
        own = await replay.jetstream().create_key_value(bucket=REPLAY.registry_bucket)
        await own.put("pool.x", b"x")
        await refused(replay_errors, f"$JS.API.STREAM.INFO.{REGISTRY_STREAM}",
                      replay.jetstream(timeout=DENIED_S).key_value(SUBJECTS.registry_bucket))
        await unheard(secured, SUBJECTS.all_metrics(), replay, replay_errors,
                      SUBJECTS.metrics("pool-a", "pod-0"), encode(snapshot()))
    finally:
        await status.close()
        await replay.close()


async def test_every_service_works_with_its_own_credentials(
    secured: SecuredNats, tmp_path: Path, simulated_pods: Callable[..., SimulatedPods]
) -> None:
    pods = simulated_pods(2)
    registry_file = tmp_path / "pool.yaml"
    pool_doc = pool(endpoints=0, allowedNetworks=["127.0.0.0/8"])
    pool_doc["spec"]["endpoints"] = [
        {"name": f"pod-{i}", "address": "127.0.0.1", "port": port}
        for i, port in enumerate(pods.ports)]
    registry_file.write_text(dump(pool_doc, model(pods.model)))
    logs = {name: tmp_path / f"{name}.log" for name in ("registry", "collector")}
    processes = []
    try:
        for name, argv in (
            ("registry", ["registry", str(registry_file), "--metrics-port", "0"]),
            ("collector", ["collector", "--metrics-port", "0", "--collector-id", "c1"]),
        ):
            processes.append(start_service([*argv, "--nats-url", secured.url,
                                            *secured.flags(name)], logs[name]))
        picker = PickerProcess("pool-a", secured.url, tmp_path,
                               extra_args=tuple(secured.flags("picker"))).start()
        try:
            # Four Python services start at once here; on a busy machine that takes a while.
            picker.wait_ready(timeout=60)
            status = await secured.connect("status")
            try:
                # The collector creates the recording streams beside its first scrapes; the
                # registry's writes reach theirs through the server-side source.
                deadline = time.monotonic() + 15
                for stream in (SUBJECTS.metrics_stream, SUBJECTS.registry_stream):
                    while not await recorded_messages(status, stream):
                        assert time.monotonic() < deadline, f"nothing in {stream} in 15 s"
                        await asyncio.sleep(0.2)
                await status.jetstream(timeout=2).stream_info(SUBJECTS.decisions_stream)
            finally:
                await status.close()
            # ``lig record`` reads every recording with the status user's credentials.
            recorded = await asyncio.to_thread(subprocess.run, [
                sys.executable, "-m", "lig.cli", "record", "--out", str(tmp_path / "r.ligrec"),
                "--since", "1m", "--nats-url", secured.url, *secured.flags("status"),
                "--log-level", "INFO"], capture_output=True, text=True, timeout=60)
            assert recorded.returncode == 0, recorded.stdout + recorded.stderr
            assert "registry_change" in recorded.stdout and "snapshot" in recorded.stdout, \
                recorded.stdout
            result = await asyncio.to_thread(status_until_fresh, [
                "--nats-url", secured.url, *secured.flags("status"),
                "--state-dir", str(tmp_path / "none")])
            assert result.returncode == 0, result.stdout + result.stderr
            assert "2 pods, 2 fresh" in result.stdout, result.stdout
        finally:
            picker.stop()
        log_text = picker.log() + "".join(path.read_text() for path in logs.values())
        assert "violation" not in log_text.lower(), log_text[-3000:]
    finally:
        for process in processes:
            process.terminate()
            process.wait(10)


async def test_lig_replay_runs_as_the_replay_user_under_its_prefix(
        secured: SecuredNats, tmp_path: Path) -> None:
    recording = tmp_path / "r.ligrec"
    now = time.time_ns()
    with recording.open("wb") as out:
        writer = Writer(out, FileHeader(now, now, now + 10**9, SUBJECTS.prefix))
        writer.add(Kind.REGISTRY_STATE, Entry(now, "pool.pool-a", b"opaque"))
        writer.add(Kind.SNAPSHOT, Entry(now, "metrics.pool-a.pod-0", encode(snapshot())))
        writer.close()
    replay = await secured.connect("replay")
    try:
        heard: list[bytes] = []

        async def keep(message) -> None:  # type: ignore[no-untyped-def]
            heard.append(message.data)

        await subscribed(replay, REPLAY.all_metrics(), cb=keep)
        result = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "lig.cli", "replay", str(recording), "--nats-url", secured.url,
            "--prefix", REPLAY.prefix, *secured.flags("replay"), "--log-level", "INFO"],
            capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
        # A denied publish or KV write would leave these missing (or time out: exit 1).
        await eventually(lambda: len(heard) == 1, within=5, what="the replayed snapshot")
        kv = await replay.jetstream().key_value(REPLAY.registry_bucket)
        assert (await kv.get("pool.pool-a")).value == b"opaque"
    finally:
        await replay.close()
