"""Simulated vLLM pods for tests: ``lig sim`` as a real subprocess on free loopback ports.

Use the context manager directly::

    with SimulatedPods(2, loras=["sql-lora"], time_scale=20) as pods:
        httpx.post(pods.url(0) + "/v1/completions", json={...})
        pods.set_faults(1, failure_rate=1.0)

or the ``simulated_pods`` fixture, a factory whose pods are stopped after the test::

    def test_x(simulated_pods):
        pods = simulated_pods(3, metrics_format="v0")

Pod ``i`` listens on ``pods.ports[i]`` (consecutive ports); ``start()`` returns once every pod
answers ``/health``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import pytest

from tests.support.ports import free_port_range
from tests.support.processes import die_with_parent

REPO_ROOT = Path(__file__).resolve().parents[2]


class SimulatedPods:
    """``count`` simulated vLLM pods served by one ``lig sim`` process."""

    def __init__(
        self,
        count: int = 1,
        *,
        loras: Sequence[str] = (),
        max_loras: int | None = None,
        time_scale: float = 10.0,
        metrics_format: str = "v1",
        model: str = "sim-model",
        seed: int = 0,
        extra_args: Sequence[str] = (),
        port_args: Callable[[int], Sequence[str]] | None = None,
        port_span: int | None = None,
    ) -> None:
        self.count = count
        # More flags that depend on the first pod's port (e.g. ports at a fixed offset from it),
        # and how many consecutive ports to lease from it (the pods take the first ``count``;
        # the rest are for those flags): an unleased port is not safe to bind.
        self._port_args = port_args
        self._port_span = max(count, port_span or count)
        self.model = model
        self.loras = tuple(loras)
        self.time_scale = time_scale
        self.metrics_format = metrics_format
        self.ports: list[int] = []
        self._args = [
            "--pods", str(count), "--model", model, "--time-scale", str(time_scale),
            "--metrics-format", metrics_format, "--seed", str(seed),
            *(arg for name in loras for arg in ("--lora", name)),
            *(["--max-loras", str(max_loras)] if max_loras is not None else []),
            *extra_args,
        ]
        self._process: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def url(self, index: int = 0) -> str:
        """Base URL of pod ``index``, e.g. ``http://127.0.0.1:41234``."""
        return f"http://127.0.0.1:{self.ports[index]}"

    def address(self, index: int = 0) -> str:
        """``ip:port`` of pod ``index``, as the gateway's endpoints name it."""
        return f"127.0.0.1:{self.ports[index]}"

    def start(self, timeout: float = 30.0) -> SimulatedPods:
        """Start the process on leased ports and wait until every pod answers ``/health``."""
        assert self._process is None, "already started: its process would be left running"
        base = free_port_range(self._port_span)
        self.ports = list(range(base, base + self.count))
        if self._log is not None:
            self._log.close()
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - outlives this call; closed on exit
        self._process = subprocess.Popen(
            [sys.executable, "-m", "lig.cli", "sim", "--host", "127.0.0.1",
             "--base-port", str(base), *self._args,
             *(self._port_args(base) if self._port_args is not None else ())],
            cwd=REPO_ROOT,
            env=os.environ | {"PYTHONPATH": str(REPO_ROOT)},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            for index in range(self.count):
                while True:
                    if self._process.poll() is not None:
                        raise RuntimeError(f"lig sim exited early:\n{self.output()}")
                    try:
                        if client.get(self.url(index) + "/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if time.monotonic() > deadline:
                        self.stop()
                        raise TimeoutError(f"lig sim not healthy in {timeout}s:\n{self.output()}")
                    time.sleep(0.05)
        return self

    def output(self) -> str:
        """Everything the process logged so far."""
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def set_faults(self, index: int, **faults: float | bool | str) -> dict[str, Any]:
        """Change pod ``index``'s faults (``failure_rate``, ``metrics_delay``, ``hang``,
        ``gray``)."""
        response = httpx.post(self.url(index) + "/admin/faults", json=faults, timeout=5.0)
        response.raise_for_status()
        return response.json()

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL after 5 s)."""
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> SimulatedPods:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
        if self._log is not None:
            self._log.close()


@pytest.fixture
def simulated_pods() -> Iterator[Callable[..., SimulatedPods]]:
    """A factory: ``simulated_pods(count, **options)`` starts pods that stop after the test."""
    started: list[SimulatedPods] = []

    def start(count: int = 1, **options: Any) -> SimulatedPods:
        pods = SimulatedPods(count, **options)
        started.append(pods)
        return pods.start()

    yield start
    for pods in started:
        pods.__exit__(None, None, None)
