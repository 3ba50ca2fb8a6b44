"""The service host (issue 12): every service's settings come from flags, then ``LIG_<FLAG>``
variables, then defaults, with errors naming both; a port in use ends every service the same way:
one line, exit code 1."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.collector.main import configure as collector_flags
from services.collector.main import settings_from as collector_settings
from services.kvevents.main import configure as kv_events_flags
from services.kvevents.main import settings_from as kv_events_settings
from services.kvevents.targets import PortSpec
from services.picker.main import configure as picker_flags
from services.picker.main import settings_from as picker_settings
from services.registry.main import configure as registry_flags
from services.registry.main import settings_from as registry_settings
from shared.errors import ConfigError
from shared.host.errors import PortInUse
from shared.host.lifespan import Lifespan
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
POOL_YAML = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {name: pool-a}
spec:
  targetPortNumber: 8000
  selector: {app: a}
  allowedNetworks: [127.0.0.0/8]
  endpoints: [{name: pod-0, address: 127.0.0.1}]
"""


def parse(configure: object, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)  # type: ignore[operator]
    return parser.parse_args(argv)


@pytest.fixture(autouse=True)
def _no_lig_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("LIG_") or name == "KUBECONFIG":
            monkeypatch.delenv(name)


def test_flags_win_over_the_environment_which_wins_over_defaults(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert picker_settings(parse(picker_flags)).grpc_port == 9002
    monkeypatch.setenv("LIG_GRPC_PORT", "7002")  # a flag that had no variable before
    monkeypatch.setenv("LIG_DRAIN_DELAY", "2.5")
    monkeypatch.setenv("LIG_NO_SUCH_FLAG", "1")
    settings = picker_settings(parse(picker_flags))
    assert (settings.grpc_port, settings.drain_delay) == (7002, 2.5)
    assert picker_settings(parse(picker_flags, "--grpc-port", "8002")).grpc_port == 8002
    monkeypatch.setenv("LIG_LOAD_ESTIMATE", "no")
    assert picker_settings(parse(picker_flags)).load_estimate is False
    assert picker_settings(parse(picker_flags, "--load-estimate")).load_estimate is True
    monkeypatch.setenv("LIG_INTERVAL", "0.1")
    assert collector_settings(parse(collector_flags)).interval_s == 0.1
    monkeypatch.setenv("LIG_WATCH_INTERVAL", "0")
    assert registry_settings(parse(registry_flags, "a.yaml")).watch_interval == 0


def test_kv_events_reads_every_flag_from_its_variable_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = kv_events_settings(parse(kv_events_flags))
    assert (defaults.events, defaults.replay, defaults.metrics_port) == (
        PortSpec(5557), PortSpec(5558), 9093)
    for variable, value in (("LIG_EVENTS_PORT", "+1000"), ("LIG_REPLAY_PORT", "none"),
                            ("LIG_DP_RANKS", "2"), ("LIG_SHARDS", "3"), ("LIG_SHARD", "2"),
                            ("LIG_REPLAY_TIMEOUT", "0.5"), ("LIG_MAX_MESSAGE_BYTES", "4096"),
                            ("LIG_RECORD_MAX_AGE", "0"), ("LIG_RECORD_MAX_BYTES", "1024"),
                            ("LIG_METRICS_PORT", "0")):
        monkeypatch.setenv(variable, value)
    settings = kv_events_settings(parse(kv_events_flags))
    assert (settings.events, settings.replay, settings.ranks, settings.shards,
            settings.shard, settings.stream.replay_timeout_s, settings.limits.max_message_bytes,
            settings.record_max_age_s, settings.record_max_bytes, settings.metrics_port) == (
        PortSpec(1000, relative=True), None, range(2), 3, 2, 0.5, 4096, 0.0, 1024, 0)
    assert kv_events_settings(parse(kv_events_flags, "--events-port", "-443")).events \
        == PortSpec(-443, relative=True)


SETTINGS = {"picker": (picker_flags, picker_settings),
            "kv-events": (kv_events_flags, kv_events_settings)}


@pytest.mark.parametrize(("service", "variable", "value", "flag"), [
    ("picker", "LIG_GRPC_PORT", "ninety", "--grpc-port"),
    ("picker", "LIG_STALE_AFTER", "0", "--stale-after"),
    ("picker", "LIG_WORKERS", "0", "--workers"),
    ("picker", "LIG_REJECT_UNKNOWN_MODELS", "maybe", "--reject-unknown-models"),
    ("picker", "LIG_NATS_REPLICAS", "9", "--nats-replicas"),
    ("kv-events", "LIG_EVENTS_PORT", "eighty", "--events-port"),
    ("kv-events", "LIG_REPLAY_PORT", "70000", "--replay-port"),
    ("kv-events", "LIG_DP_RANKS", "0", "--dp-ranks"),
    ("kv-events", "LIG_SHARD", "1", "--shard"),
    ("kv-events", "LIG_MAX_MESSAGE_BYTES", "63", "--max-message-bytes"),
])
def test_a_bad_variable_is_an_error_naming_the_variable_and_the_flag(
        monkeypatch: pytest.MonkeyPatch, service: str, variable: str, value: str,
        flag: str) -> None:
    configure, settings_from = SETTINGS[service]
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as error:
        settings_from(parse(configure))
    assert variable in str(error.value) and flag in str(error.value)


def test_help_names_the_variable_of_every_flag() -> None:
    for configure in (picker_flags, collector_flags, registry_flags, kv_events_flags):
        parser = argparse.ArgumentParser()
        configure(parser)  # type: ignore[operator]
        for action in parser._actions:
            if action.dest != "help":
                assert "env LIG_" in (action.help or ""), action.option_strings


def test_help_is_the_same_on_every_host() -> None:
    # A default computed at start (host name and pid) used to appear in help, so docs/reference.md's
    # generated help wrapped differently from host to host and its test failed elsewhere.
    for configure in (collector_flags, kv_events_flags):
        parser = argparse.ArgumentParser()
        configure(parser)  # type: ignore[operator]
        text = parser.format_help()
        assert str(os.getpid()) not in text and "(default: HOSTNAME-PID;" in " ".join(
            text.split())


def _taken_port() -> socket.socket:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder


@pytest.mark.parametrize("service", ["picker", "collector", "registry", "kv-events"])
def test_a_port_in_use_ends_every_service_the_same_way(service: str, tmp_path: Path) -> None:
    pools = tmp_path / "pools.yaml"
    pools.write_text(POOL_YAML)
    with _taken_port() as holder:
        taken = holder.getsockname()[1]
        command = {
            "picker": ["--pool", "p", "--grpc-port", str(free_port()),
                       "--health-port", str(free_port())],
            "collector": [],
            "registry": [str(pools)],
            "kv-events": [],
        }[service]
        result = subprocess.run(
            [sys.executable, "-m", "lig.cli", service, *command, "--host", "127.0.0.1",
             "--metrics-port", str(taken), "--nats-url", "nats://127.0.0.1:1",
             "--log-level", "WARNING"],
            capture_output=True, text=True, timeout=30, cwd=ROOT)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 1, output
    assert output.splitlines() == [f"lig {service}: error: cannot listen on 127.0.0.1:{taken} "
                                   "(metrics): [Errno 98] Address already in use"], output


async def test_the_lifespan_releases_in_reverse_order_within_bounds() -> None:
    released: list[str] = []

    async def hang() -> None:
        released.append("hanging close")
        await asyncio.sleep(60)

    started = time.monotonic()
    with pytest.raises(PortInUse):  # a service failing halfway through starting
        async with Lifespan() as life:
            life.callback(lambda: released.append("opened first"))
            life.on_close(hang, within=0.2)
            sleeper = life.task(asyncio.sleep(60), grace=0.2)
            life.callback(lambda: released.append("opened last"))
            raise PortInUse("test", "127.0.0.1", 1, "taken")
    assert released == ["opened last", "hanging close", "opened first"]
    assert sleeper.cancelled()
    # 0.2 s + 0.2 s, not the 60 s the steps would take; the bound is a stop's (a few seconds),
    # far from both, so a loaded machine's late timers do not reach it.
    assert time.monotonic() - started < 5
