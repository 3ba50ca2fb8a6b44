"""Child processes of ``lig up``: start them, keep their logs, notice deaths, stop them all.

Every child runs in a session (and so a process group) of its own: the terminal's Ctrl-C reaches
only ``lig up``, which then stops the children itself, and signalling a child's group reaches
anything the child spawned. On Linux each child also asks the kernel for SIGTERM when ``lig up``
dies (``PR_SET_PDEATHSIG``), so even a supervisor killed with SIGKILL leaves no orphans.

Children write straight into ``<log_dir>/<name>.log`` (their logs survive a supervisor crash and a
slow terminal never blocks them); :meth:`Supervisor.pump_logs` follows those files to echo new
lines with a per-service prefix when asked to.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import msgspec

_PR_SET_PDEATHSIG = 1


class ChildSpec(msgspec.Struct, frozen=True):
    """What to run: a name (used for the log file and the prefix), argv and extra environment."""

    name: str
    argv: list[str]
    env: dict[str, str] = {}


def _parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive SIGTERM when its parent dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def set_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return set_death_signal


class Child:
    """One started child process and its log file."""

    def __init__(self, spec: ChildSpec, process: subprocess.Popen[bytes], log_path: Path) -> None:
        self.spec = spec
        self.process = process
        self.log_path = log_path
        self.started = time.monotonic()
        self.stopping = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        return self.process.pid

    def exited(self) -> bool:
        """Whether the process has exited (reaps it if so)."""
        return self.process.poll() is not None

    def group_alive(self) -> bool:
        """Whether any process of the child's group (the child or what it spawned) still runs."""
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # The group exists while the reaped-or-not leader is a zombie: reap, then ask again.
        if self.process.poll() is None:
            return True
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's whole process group (ignored if it is already gone)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def last_lines(self, count: int = 20) -> list[str]:
        """The last ``count`` lines of the child's log file."""
        try:
            with self.log_path.open("rb") as log:
                tail = deque(log, maxlen=count)
        except OSError:
            return []
        return [line.decode(errors="replace").rstrip("\n") for line in tail]

    def describe_exit(self, lines: int = 20) -> str:
        """A report of how the child ended, with the tail of its log."""
        code = self.process.returncode
        if code is None:
            how = "is still running"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        uptime = time.monotonic() - self.started
        tail = self.last_lines(lines)
        text = f"{self.name} (pid {self.pid}) {how} after {uptime:.1f}s"
        if not tail:
            return text + f"; its log {self.log_path} is empty"
        return text + f"; last lines of {self.log_path}:\n" + "\n".join(
            f"    {line}" for line in tail
        )


class _LogFollower:
    """Reads what a child appended to its log since the last call, line by line."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._offset = 0
        self._partial = b""

    def new_lines(self, final: bool = False) -> list[str]:
        try:
            with self._path.open("rb") as log:
                log.seek(self._offset)
                data = log.read()
        except OSError:
            return []
        self._offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        if final and self._partial:
            lines.append(self._partial)
            self._partial = b""
        return [line.decode(errors="replace") for line in lines]


class Supervisor:
    """Starts children with their logs under ``log_dir`` and stops every one of them.

    ``echo`` receives each new log line, prefixed with the child's name, when
    :meth:`pump_logs` runs (``lig up -v``); None keeps the logs in their files only.
    """

    def __init__(self, log_dir: Path, echo: Callable[[str], None] | None = None) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []
        self._echo = echo
        self._followers: dict[str, _LogFollower] = {}
        self._prefix_width = 8

    def start(self, spec: ChildSpec) -> Child:
        """Start ``spec`` in its own session, stdout and stderr appended to its log file."""
        if any(child.name == spec.name for child in self.children):
            raise ValueError(f"a child named {spec.name!r} was already started")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{spec.name}.log"
        child = Child(spec, self._spawn(spec, log_path, "wb"), log_path)
        self.children.append(child)
        self._followers[spec.name] = _LogFollower(log_path)
        self._prefix_width = max(self._prefix_width, len(spec.name))
        return child

    def restart(self, name: str) -> Child:
        """Start the exited child ``name`` again, with the same spec, appending to its log.

        ``lig up`` never does this (a death stops the stack); the chaos tool restarts the
        services it killed.
        """
        index, old = next((i, c) for i, c in enumerate(self.children) if c.name == name)
        if not old.exited():
            raise ValueError(f"{name} is still running")
        child = Child(old.spec, self._spawn(old.spec, old.log_path, "ab"), old.log_path)
        self.children[index] = child
        return child

    @staticmethod
    def _spawn(spec: ChildSpec, log_path: Path, mode: str) -> subprocess.Popen[bytes]:
        with log_path.open(mode) as log:
            return subprocess.Popen(
                spec.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **spec.env},
                start_new_session=True,
                preexec_fn=_parent_death_signal(),
            )

    def first_exited(self) -> Child | None:
        """The first child (in start order) that exited although nobody asked it to."""
        for child in self.children:
            if not child.stopping and child.exited():
                return child
        return None

    def pump_logs(self, final: bool = False) -> None:
        """Echo the lines children logged since the last call (no-op without ``echo``)."""
        if self._echo is None:
            return
        for child in self.children:
            for line in self._followers[child.name].new_lines(final):
                self._echo(f"{child.name:<{self._prefix_width}} | {line}")

    def stop_all(self, timeout: float = 4.0) -> list[str]:
        """SIGTERM every child's group (newest first), SIGKILL what is left after ``timeout``.

        Returns the names of the children that had to be killed. Every group is gone on return.
        """
        for child in reversed(self.children):
            child.stopping = True
            if child.group_alive():
                child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        alive = [child for child in self.children if child.group_alive()]
        while alive and time.monotonic() < deadline:
            time.sleep(0.02)
            self.pump_logs()
            alive = [child for child in alive if child.group_alive()]
        for child in alive:
            child.signal_group(signal.SIGKILL)
        for child in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(timeout=2)
            while child.group_alive() and time.monotonic() < deadline + 2:
                time.sleep(0.01)
        self.pump_logs(final=True)
        return [child.name for child in alive]
