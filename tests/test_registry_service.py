"""The registry service against a real nats-server: watching, reloads, bad edits, NATS restarts,
and ``lig registry`` as a real process (SIGHUP, SIGTERM, --check, metrics)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.client import Client
from nats.js.errors import BucketNotFoundError

from lig import up
from lig.topology import EXAMPLE_CONFIG
from services.registry.loader import Registry
from services.registry.metrics import RegistryMetrics
from services.registry.publisher import Publisher, read_bucket
from services.registry.reconciler import PROBLEMS_LOGGED, SETTLE, Reconciler
from shared.nats_connection import NatsSettings, connect
from shared.schemas import EndpointSet, InferenceModel, decode
from shared.subjects import Subjects
from tests.support.nats_server import NatsServer
from tests.support.ports import LEASES, free_port
from tests.support.processes import die_with_parent
from tests.support.registry_yaml import dump, model, pool

BUCKET = Subjects().registry_bucket
LIG = str(Path(sys.executable).with_name("lig"))
DEADLINE = 10.0  # generous: the machine is shared; the 1 s promise is asserted separately
STOP_S = 5.0  # the registry stops within a few seconds of SIGTERM (the product's promise)


async def bucket(nc: Client) -> dict[str, bytes]:
    """Live keys and values of the registry bucket ({} when it does not exist)."""
    try:
        entries = await read_bucket(nc.jetstream(), BUCKET)
    except BucketNotFoundError:
        return {}
    return {key: entry.value or b"" for key, entry in entries.items()}


async def poll_until(check: Callable[[], Awaitable[bool]], within: float = DEADLINE) -> float:
    """Await the async ``check`` until it is true; return the seconds it took (fail after
    ``within``). Unlike tests.support.waiting.eventually, the check may query NATS."""
    start = time.monotonic()
    while not await check():
        assert time.monotonic() - start < within, "condition not reached in time"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def write(path: Path, text: str) -> None:
    """Rewrite an input in place (truncate, then write), as most editors and tools do."""
    await asyncio.to_thread(path.write_text, text)


def criticality(contents: dict[str, bytes], key: str = "model.pool-a.model-a") -> str | None:
    return decode(contents[key], InferenceModel).criticality if key in contents else None


class Running:
    """A Reconciler publishing ``inputs`` over its own connection, run as a task."""

    def __init__(self, inputs: Path, nats_url: str, **options: float | bool) -> None:
        self.inputs = inputs
        self.url = nats_url
        self.metrics = RegistryMetrics()
        self.reconciler = Reconciler([str(inputs)], self.metrics, **options)
        # The desired state after each check of the inputs: how many checks an edit took to be
        # loaded (and published, in the same pass), counted rather than timed.
        self.checked: list[Registry | None] = []
        check = self.reconciler.check_inputs

        async def counted_check() -> None:
            await check()
            self.checked.append(self.reconciler.desired)

        self.reconciler.check_inputs = counted_check  # type: ignore[method-assign]
        self._task: asyncio.Task[None] | None = None
        self._nc: Client | None = None

    async def start(self) -> None:
        async def on_reconnect() -> None:
            self.reconciler.request_resync()

        self._nc = await connect(NatsSettings(url=self.url), "test-registry",
                                 on_reconnect=on_reconnect)
        publisher = Publisher(self._nc.jetstream(), BUCKET)
        self._task = asyncio.create_task(self.reconciler.run(publisher))

    async def stop(self) -> None:
        assert self._task is not None and self._nc is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._nc.close()

    def sample(self, name: str, **labels: str) -> float | None:
        return self.metrics.prometheus.get_sample_value(name, labels)


@contextlib.asynccontextmanager
async def serving(inputs: Path, nats_url: str, **options: float | bool) -> AsyncIterator[Running]:
    """A started :class:`Running`, stopped on leaving."""
    service = Running(inputs, nats_url, **options)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    path = tmp_path / "registry.yaml"
    path.write_text(dump(pool(), model(), model("model-b")))
    return path


@pytest.fixture
async def running(inputs: Path, nats_server) -> AsyncIterator[Running]:
    service = Running(inputs, nats_server.url, watch_interval=0.5, resync_interval=0)
    await service.start()
    yield service
    await service.stop()


async def test_edit_is_published_within_a_second_and_removal_becomes_delete(
    running: Running, nc: Client, inputs: Path
) -> None:
    await poll_until(lambda: _has_keys(nc, 4))

    checks_before = len(running.checked)
    await write(inputs, dump(pool(), model(criticality="Critical"), model("model-b")))
    await poll_until(async_check(nc, lambda c: criticality(c) == "Critical"))
    # Within a second, counted in checks 0.5 s apart (a loaded machine stretches seconds, not
    # checks): the first check that starts after the write loads the edit, and the same pass
    # publishes it; the check running during the write may miss it.
    loaded_by = next(index for index, desired in enumerate(running.checked[checks_before:], 1)
                     if desired is not None and any(model.model_name == "model-a" and
                                                    model.criticality == "Critical"
                                                    for model in desired.models))
    assert loaded_by <= 2, f"the edit was loaded by check {loaded_by} after the write"

    await write(inputs, dump(pool(), model(criticality="Critical")))
    await poll_until(async_check(nc, lambda c: "model.pool-a.model-b" not in c))
    history = await (await nc.jetstream().key_value(BUCKET)).history("model.pool-a.model-b")
    assert history[-1].operation == "DEL", [(e.revision, e.operation, e.value) for e in history]
    assert running.sample("lig_registry_reloads_total", outcome="ok") == 3
    assert running.sample("lig_registry_objects", kind="model") == 1


async def test_invalid_edit_is_logged_counted_and_previous_state_stays(
    running: Running, nc: Client, inputs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await poll_until(lambda: _has_keys(nc, 4))
    good = await bucket(nc)
    caplog.set_level(logging.ERROR, logger="lig.registry")

    bad = dump(pool(), model(targetModels=[{"name": "x", "weight": 0}]), model("model-b"))
    await write(inputs, bad)

    async def rejected() -> bool:
        return running.sample("lig_registry_reloads_total", outcome="invalid") == 1

    await poll_until(rejected)
    assert f"{inputs}:" in caplog.text
    assert "document 2: spec.targetModels[0].weight" in caplog.text
    assert running.sample("lig_registry_input_valid") == 0
    assert await bucket(nc) == good
    assert running.sample("lig_registry_kv_writes_total", op="put") == 4

    await write(inputs, dump(pool(), model(criticality="Sheddable")))  # fixed: published again
    await poll_until(async_check(nc, lambda c: criticality(c) == "Sheddable"
                                 and "model.pool-a.model-b" not in c))
    assert running.sample("lig_registry_input_valid") == 1


async def test_invalid_input_at_start_leaves_the_bucket_untouched(
    nats_server, nc: Client, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    earlier = tmp_path / "earlier.yaml"
    await write(earlier, dump(pool(), model()))
    first = Running(earlier, nats_server.url)
    await first.start()
    await poll_until(lambda: _has_keys(nc, 3))
    await first.stop()
    published = await bucket(nc)

    broken = tmp_path / "broken.yaml"
    await write(broken, dump(pool(), model(pool_name="missing")))
    second = Running(broken, nats_server.url, resync_interval=0.2)
    await second.start()
    try:
        await poll_until(lambda: _sample_is(second, "lig_registry_reloads_total", 1,
                                            outcome="invalid"))
        assert "nothing published" in caplog.text
        assert "no InferencePool named 'missing'" in caplog.text
        assert await bucket(nc) == published
        assert second.sample("lig_registry_publishes_total", outcome="ok") == 0
    finally:
        await second.stop()


async def test_wiped_key_is_restored_by_the_periodic_resync(
    nats_server, nc: Client, inputs: Path
) -> None:
    service = Running(inputs, nats_server.url, resync_interval=0.3)
    await service.start()
    try:
        await poll_until(lambda: _has_keys(nc, 4))
        kv = await nc.jetstream().key_value(BUCKET)
        await kv.delete("pool.pool-a")
        await kv.put("model.pool-a.stray", b"left by someone")
        await poll_until(async_check(nc, lambda c: "pool.pool-a" in c
                                     and "model.pool-a.stray" not in c))
    finally:
        await service.stop()


async def test_nats_restarted_with_an_empty_store_gets_the_state_again(
    nats_server, running: Running, inputs: Path
) -> None:
    if not isinstance(nats_server, NatsServer):
        pytest.skip("needs the restartable local nats-server")
    client = await nats.connect(nats_server.url)
    await poll_until(lambda: _has_keys(client, 4))
    await client.close()

    nats_server.stop()
    shutil.rmtree(nats_server.store_dir)  # the bucket is gone when NATS comes back
    nats_server.start()

    client = await nats.connect(nats_server.url)
    try:
        await poll_until(lambda: _has_keys(client, 4))  # resync_interval=0: the reconnect did it
        # Republished from memory (one load only), in a second successful pass.
        assert running.sample("lig_registry_reloads_total", outcome="ok") == 1
        assert running.sample("lig_registry_publishes_total", outcome="ok") == 2
    finally:
        await client.close()


async def test_emptied_file_folder_or_endpoints_are_refused_and_the_state_stays(
    nats_server, nc: Client, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "registry"
    folder.mkdir()
    (folder / "pool.yaml").write_text(dump(pool()))
    (folder / "models.yaml").write_text(dump(model(), model("model-b")))
    caplog.set_level(logging.INFO, logger="lig.registry")
    async with serving(folder, nats_server.url, resync_interval=0.3) as service:
        await poll_until(lambda: _has_keys(nc, 4))
        good = await bucket(nc)

        async def refused(reason: str, count: int) -> bool:
            return service.sample("lig_registry_refused_total", reason=reason) == count

        await write(folder / "pool.yaml", "")  # truncated by an editor: models lose their pool
        await write(folder / "models.yaml", "")
        await poll_until(lambda: refused("no_pools", 1))
        assert "REFUSED to publish: the inputs define no pools" in caplog.text
        assert "would delete every pool (pool-a)" in caplog.text
        assert "--allow-empty" in caplog.text
        assert service.sample("lig_registry_input_valid") == 0
        assert service.sample("lig_registry_objects", kind="pool") == 1  # what stays published

        (folder / "pool.yaml").unlink()
        (folder / "models.yaml").unlink()  # an empty folder: refused the same way
        await poll_until(lambda: refused("no_pools", 2))

        await write(folder / "all.yaml", dump(pool(endpoints=0), model()))
        await poll_until(lambda: refused("no_endpoints", 1))
        assert "list no endpoints for pool(s) that have some now (pool-a)" in caplog.text

        # The kept state is the desired one: a wiped key comes back with the good value.
        await (await nc.jetstream().key_value(BUCKET)).delete("endpoints.pool-a")
        await poll_until(async_check(nc, lambda c: c == good))
        assert service.sample("lig_registry_kv_writes_total", op="delete") == 0

        await write(folder / "all.yaml", dump(pool(endpoints=1), model()))  # a real edit
        await poll_until(async_check(nc, lambda c: "model.pool-a.model-b" not in c
                                     and c["endpoints.pool-a"] != good["endpoints.pool-a"]))
        assert service.sample("lig_registry_input_valid") == 1


async def test_first_start_on_an_empty_folder_keeps_an_earlier_state_and_allow_empty_wipes(
    nats_server, nc: Client, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    caplog.set_level(logging.INFO, logger="lig.registry")
    # Nothing published yet anywhere: an empty folder is simply nothing to publish.
    async with serving(empty, nats_server.url) as fresh:
        await poll_until(lambda: _sample_is(fresh, "lig_registry_publishes_total", 1,
                                            outcome="ok"))
        assert "the inputs define no pools" in caplog.text and "REFUSED" not in caplog.text

    earlier = tmp_path / "earlier.yaml"
    await write(earlier, dump(pool(), model()))
    async with serving(earlier, nats_server.url):
        await poll_until(lambda: _has_keys(nc, 3))
    published = await bucket(nc)

    # A restart on an emptied ConfigMap.
    async with serving(empty, nats_server.url, resync_interval=0.2) as restarted:
        await poll_until(lambda: _sample_is(restarted, "lig_registry_refused_total", 1,
                                            reason="no_pools"))
        assert "nothing published; the bucket keeps what it holds" in caplog.text
        await asyncio.sleep(0.5)  # resyncs come and go
        assert await bucket(nc) == published
        assert restarted.sample("lig_registry_refused_total", reason="no_pools") == 1

    async with serving(empty, nats_server.url, allow_empty=True):
        await poll_until(lambda: _has_keys(nc, 0))


def async_check(nc: Client, predicate: Callable[[dict[str, bytes]], bool]
                ) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return predicate(await bucket(nc))

    return check


async def _has_keys(nc: Client, count: int) -> bool:
    return len(await bucket(nc)) == count


async def _sample_is(service: Running, name: str, value: float, **labels: str) -> bool:
    return service.sample(name, **labels) == value


# --- lig registry as a real process -------------------------------------------------------------


def start_lig(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    return spawn(tmp_path, [LIG, "registry", *args])


def spawn(tmp_path: Path, argv: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / f"registry-{time.monotonic_ns()}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                   preexec_fn=die_with_parent)
    return process, log


async def metrics_page(port: int) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"http://127.0.0.1:{port}/metrics")).text


def stop_within(process: subprocess.Popen[bytes], seconds: float) -> tuple[int, float]:
    start = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=DEADLINE)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    took = time.monotonic() - start
    assert took < seconds, f"took {took:.2f} s to stop"
    return code, took


async def test_process_reloads_on_sighup_serves_metrics_and_stops_on_sigterm(
    nats_server, nc: Client, inputs: Path, tmp_path: Path
) -> None:
    metrics_port = free_port()
    process, log = start_lig(
        tmp_path, str(inputs), "--nats-url", nats_server.url, "--host", "127.0.0.1",
        "--metrics-port", str(metrics_port), "--watch-interval", "0",  # reload only on SIGHUP
    )
    try:
        await poll_until(lambda: _has_keys(nc, 4))
        assert "ready: watching" in await asyncio.to_thread(log.read_text)

        await write(inputs, dump(pool(), model(criticality="Sheddable")))
        process.send_signal(signal.SIGHUP)
        await poll_until(async_check(nc, lambda c: criticality(c) == "Sheddable"
                                     and "model.pool-a.model-b" not in c))

        page = await metrics_page(metrics_port)
        assert 'lig_registry_reloads_total{outcome="ok"} 2.0' in page
        assert 'lig_registry_kv_writes_total{op="delete"} 1.0' in page
        assert "lig_registry_last_successful_reload_timestamp_seconds" in page
    finally:
        code, _ = stop_within(process, STOP_S)
    assert code == 0
    assert "registry stopped" in await asyncio.to_thread(log.read_text)


def test_process_stops_on_sigterm_while_nats_is_unreachable(inputs: Path, tmp_path: Path) -> None:
    process, log = start_lig(tmp_path, str(inputs), "--nats-url", f"nats://127.0.0.1:{free_port()}",
                             "--metrics-port", "0")
    deadline = time.monotonic() + DEADLINE
    while "loaded 1 pools" not in log.read_text():
        assert time.monotonic() < deadline and process.poll() is None, log.read_text()
        time.sleep(0.05)
    code, _ = stop_within(process, STOP_S)
    assert code == 0


def test_check_command_exit_codes(inputs: Path, tmp_path: Path) -> None:
    ok = subprocess.run([LIG, "registry", "--check", str(inputs)], capture_output=True,
                        text=True, timeout=DEADLINE)
    assert ok.returncode == 0 and "valid: 1 pool(s), 2 model(s)" in ok.stdout
    inputs.write_text(dump(pool(), model(pool_name="nope")))
    bad = subprocess.run([LIG, "registry", "--check", str(inputs)], capture_output=True,
                         text=True, timeout=DEADLINE)
    assert bad.returncode == 2
    assert f"{inputs}:" in bad.stderr and "spec.poolRef.name" in bad.stderr


async def test_process_survives_deep_yaml_and_an_emptied_folder_keeping_the_state(
    nats_server, nc: Client, tmp_path: Path
) -> None:
    folder = tmp_path / "registry"
    folder.mkdir()
    (folder / "pool.yaml").write_text(dump(pool(), model(), model("model-b")))
    metrics_port = free_port()
    process, log = start_lig(
        tmp_path, str(folder), "--nats-url", nats_server.url, "--host", "127.0.0.1",
        "--metrics-port", str(metrics_port), "--watch-interval", "0.1")
    try:
        await poll_until(lambda: _has_keys(nc, 4))
        good = await bucket(nc)

        async def logged(text: str) -> bool:
            assert process.poll() is None, await asyncio.to_thread(log.read_text)
            return text in await asyncio.to_thread(log.read_text)

        # The 1 KB file of the attack: 500 nested levels.
        await write(folder / "pool.yaml", "kind: " + "[" * 500 + "]" * 500 + "\n")
        await poll_until(lambda: logged("nested deeper than 64 levels"))
        await poll_until(lambda: logged("rejected the inputs (1 problems)"))

        (folder / "pool.yaml").unlink()  # the folder is empty now
        await poll_until(lambda: logged("REFUSED to publish: the inputs define no pools"))
        await asyncio.sleep(0.5)  # a few more watch intervals
        assert process.poll() is None
        assert await bucket(nc) == good
        assert "Traceback" not in await asyncio.to_thread(log.read_text)

        page = await metrics_page(metrics_port)
        assert 'lig_registry_refused_total{reason="no_pools"} 1.0' in page
        assert 'lig_registry_reloads_total{outcome="invalid"} 1.0' in page
        assert "lig_registry_input_valid 0.0" in page
    finally:
        code, _ = stop_within(process, STOP_S)
    assert code == 0


def test_check_command_reports_deep_yaml_in_one_line_without_traceback(tmp_path: Path) -> None:
    deep = tmp_path / "deep.yaml"
    deep.write_text("kind: " + "[" * 500 + "]" * 500 + "\n")
    result = subprocess.run([LIG, "registry", "--check", str(deep)], capture_output=True,
                            text=True, timeout=DEADLINE)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"{deep}:1: document 1: kind[0][0][0][0][0][0][0]...: invalid YAML: nested deeper than "
        "64 levels",
        "invalid: 1 problem(s); nothing would be published",
    ]


async def test_publishing_thousands_of_models_logs_a_summary_not_every_key(
    nats_server, nc: Client, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    inputs = tmp_path / "fleet.yaml"
    inputs.write_text(dump(pool(), *(model(f"model-{i}") for i in range(2000))))
    caplog.set_level(logging.INFO, logger="lig.registry")
    async with serving(inputs, nats_server.url):
        await poll_until(lambda: _has_keys(nc, 2002), within=60.0)
        [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("published")]
        assert line == ("published: 2002 put, 0 deleted, 0 unchanged (pool.pool-a, "
                        "endpoints.pool-a, model.pool-a.model-0, model.pool-a.model-1, "
                        "model.pool-a.model-2 and 1,997 more)")
        assert max(len(r.getMessage()) for r in caplog.records) < 300


async def test_lig_up_registry_with_free_ports_publishes_the_pods_and_edits_to_the_folder_live(
    nats_server, nc: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = tmp_path / "local"
    shutil.copytree(EXAMPLE_CONFIG, example)  # stands for the user's examples/local
    monkeypatch.setattr(up, "EXAMPLE_CONFIG", example)
    parser = argparse.ArgumentParser()
    up.configure(parser)
    plan, _ = up.make_plan(parser.parse_args([
        "--free-ports", "--pods", "2", "--nats-url", nats_server.url,
        "--state-dir", str(tmp_path / "state")]), LEASES)
    [spec] = [child for child in plan.children() if child.name == "registry"]
    process, log = spawn(tmp_path, spec.argv)  # the very command `lig up` runs
    pool_name = plan.pool
    sql_lora = f"model.{pool_name}.sql-lora"
    try:
        await poll_until(async_check(nc, lambda c: sql_lora in c))
        endpoints = decode((await bucket(nc))[f"endpoints.{pool_name}"], EndpointSet)
        assert [e.hostport for e in endpoints.endpoints] == [
            f"127.0.0.1:{port}" for port in plan.ports.sim_ports(2)]
        assert criticality(await bucket(nc), sql_lora) == "Sheddable"

        pool_file = example / "pool.yaml"
        text = pool_file.read_text()
        await write(pool_file, text.replace("criticality: Sheddable", "criticality: Critical"))
        await poll_until(async_check(nc, lambda c: criticality(c, sql_lora) == "Critical"))
        endpoints = decode((await bucket(nc))[f"endpoints.{pool_name}"], EndpointSet)
        assert [e.port for e in endpoints.endpoints] == plan.ports.sim_ports(2)
    finally:
        code, _ = stop_within(process, STOP_S)
    assert code == 0, log.read_text()


def test_process_exits_2_on_an_unusable_endpoints_override(inputs: Path, tmp_path: Path) -> None:
    override = tmp_path / "override.yaml"
    override.write_text("pool: pool-a\nendpoints: [{name: a, address: 0.0.0.0, port: 1}]\n")
    result = subprocess.run([LIG, "registry", str(inputs), "--endpoints-override", str(override),
                             "--nats-url", f"nats://127.0.0.1:{free_port()}"],
                            capture_output=True, text=True, timeout=DEADLINE)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"lig registry: error: --endpoints-override {override}: endpoints[0].address: '0.0.0.0' "
        "is the unspecified address (a listening address meaning any, not a pod's); give the pod's "
        "own IP address"]


async def test_a_loader_bug_is_logged_and_the_previous_state_kept(
    inputs: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    reconciler = Reconciler([str(inputs)], RegistryMetrics())
    await reconciler.check_inputs()
    good = reconciler.desired
    assert good is not None

    def broken(snapshot: object, cancelled: object) -> None:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr("services.registry.reconciler.load", broken)  # a bug, not bad input
    await write(inputs, dump(pool(), model(criticality="Critical")))
    await reconciler.check_inputs()
    assert reconciler.desired is good
    assert "could not load the inputs (a registry bug" in caplog.text
    assert "RecursionError" in caplog.text


async def test_an_input_with_many_problems_logs_a_bounded_number_of_lines(
    inputs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One bad file (a 1 MB one held 200,000 duplicate keys) used to log a line per problem."""
    reconciler = Reconciler([str(inputs)], RegistryMetrics())
    await reconciler.check_inputs()
    good = reconciler.desired
    caplog.clear()
    await write(inputs, dump(pool()) + "".join(f"---\nkind: Unknown{i}\n" for i in range(5_000)))
    with caplog.at_level(logging.ERROR, logger="lig.registry"):
        await reconciler.check_inputs()
    assert reconciler.desired is good
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) <= PROBLEMS_LOGGED + 1
    assert sum("Unknown" in line for line in lines) == PROBLEMS_LOGGED
    assert "rejected the inputs (5000 problems, the first 20 logged; lig registry --check " \
        "lists them all)" in lines[-1]


async def test_a_stop_during_a_long_load_is_prompt(inputs: Path) -> None:
    """Inputs within the size limits can take minutes to parse (a million empty documents is 4
    MB); the registry used to parse on its event loop, so a SIGTERM waited for all of it."""
    reconciler = Reconciler([str(inputs)], RegistryMetrics())
    await reconciler.check_inputs()
    good = reconciler.desired
    await write(inputs, dump(pool()) + "---\n" * 300_000)  # about 10 s of parsing here
    checking = asyncio.create_task(reconciler.check_inputs())
    loop_cpu = time.thread_time()
    await asyncio.sleep(SETTLE + 1.0)
    # The loop is free while the inputs are parsed: its thread spent next to no CPU meanwhile
    # (CPU time, which a loaded machine does not stretch as it does a wall-clock bound).
    assert time.thread_time() - loop_cpu < 0.3
    assert not checking.done()
    cancelled = time.monotonic()
    checking.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await checking  # returns once the parsing thread has given up
    # Measured from the cancellation (a stop's bound), not across the sleep above, which a
    # loaded machine stretches; the parse it cuts short has about 9 s left.
    assert time.monotonic() - cancelled < STOP_S
    assert reconciler.desired is good
