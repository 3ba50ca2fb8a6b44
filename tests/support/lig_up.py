"""``lig up`` run as a user runs it: a subprocess on free ports, read line by line, stopped with
SIGTERM (and its whole process group killed if that hangs).

Its collector and pickers run with scrape and staleness timing a loaded machine meets
(:data:`LOADED_MACHINE_TIMING`), unless a test is about that timing (``timing=None``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from lig.topology import StackInfo
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]

# The product's defaults are tuned for production: a scrape every 50 ms that may take 40 ms, and
# a snapshot stale after 1 s. While the suite runs (4 workers on 2 cores) a scrape of a loaded
# `lig sim` timed out now and then, and a pod whose scrape failed is not fresh: a test about
# something else saw a pick at random, a gray pod let back in, no shedding, or `lig status`
# reporting a pod not fresh. These are values such a machine meets; set through the
# environment variables the collector's and the pickers' flags read.
SCRAPE_INTERVAL_S = 1.25
SCRAPE_TIMEOUT_S = 1.0
STALE_AFTER_S = 3.0
LOADED_MACHINE_TIMING: Mapping[str, str] = {
    "LIG_INTERVAL": str(SCRAPE_INTERVAL_S),
    "LIG_SCRAPE_TIMEOUT": str(SCRAPE_TIMEOUT_S),
    "LIG_STALE_AFTER": str(STALE_AFTER_S),
}
# `lig status` judges freshness as the stack's pickers do (its own flag, not read from the
# environment).
STATUS_STALE_AFTER = ("--stale-after", f"{STALE_AFTER_S:g}")


class RunningStack:
    """A ``lig up`` process and what it said."""

    def __init__(self, process: subprocess.Popen[str], gateway: str, state_dir: Path) -> None:
        self.process = process
        self.gateway = gateway
        self.state_dir = state_dir
        self.lines: list[str] = []
        self.ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("lig up: ready"):
                self.ready.set()

    def output(self) -> str:
        return "\n".join(self.lines)

    def read_to_end(self, within: float = 5.0) -> None:
        """After the process exited: wait until every line it wrote has been read."""
        self._reader.join(within)

    def child_pids(self) -> list[int]:
        """The pids ``lig up`` printed for its children."""
        return [int(line.rsplit("[pid ", 1)[1].rstrip("]")) for line in self.lines
                if line.endswith("]") and "[pid " in line]

    @property
    def info(self) -> StackInfo:
        info = StackInfo.read(self.state_dir)
        assert info is not None, "lig up wrote no stack.json"
        return info


@contextlib.contextmanager
def lig_up(state_dir: Path, *args: str, env: Mapping[str, str] | None = None,
           ready_within: float = 50.0,
           timing: Mapping[str, str] | None = LOADED_MACHINE_TIMING) -> Iterator[RunningStack]:
    """Run ``lig up --free-ports ARGS`` until it says it is ready; stop it on exit.

    ``env`` (default: this process's environment) gets ``timing`` on top; ``timing=None``
    leaves the product's scrape and staleness defaults, for a test about them."""
    port = free_port()
    environment = {**(os.environ if env is None else env), **(timing or {})}
    process = subprocess.Popen(
        [sys.executable, "-m", "lig.cli", "up", "--free-ports", "--port", str(port),
         "--state-dir", str(state_dir), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        cwd=REPO, start_new_session=True, env=environment,
    )
    running = RunningStack(process, f"http://127.0.0.1:{port}", state_dir)
    try:
        deadline = time.monotonic() + ready_within
        while not running.ready.wait(0.2):
            assert process.poll() is None, f"lig up exited early:\n{running.output()}"
            assert time.monotonic() < deadline, \
                f"lig up not ready in {ready_within}s:\n{running.output()}"
        yield running
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
