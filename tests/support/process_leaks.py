"""No child process outlives the test module that started it (a pytest plugin).

Not in :mod:`tests.support.processes`: fixtures defined there mark every test using them as
process-level (tests/support/process_marker.py), and this one is used by every test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def live_children() -> set[int]:
    """This process's child processes that have not exited (zombies count as exited)."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            pids |= {int(pid) for pid in (task / "children").read_text().split()}
    return {pid for pid in pids if _running(pid)}


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.fixture(scope="module", autouse=True)
def _no_process_outlives_its_module() -> Iterator[None]:
    """Fail the module whose tests leave a child process running after all of its fixtures
    are torn down: a leaked server holds its ports and CPU for the rest of the run (a double
    start leaked 40 ``lig sim`` processes in one run). It is killed, and the failure names it."""
    if not sys.platform.startswith("linux"):
        yield
        return
    before = live_children()
    yield
    deadline = time.monotonic() + 5.0  # a stopping child may take a moment to exit
    while (left := live_children() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        commands = {pid: _command(pid) for pid in left}
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        pytest.fail(f"processes left running by this module: {commands}", pytrace=False)


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"
