"""The supervisor behind ``lig up``, driven with tiny Python child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lig.supervisor import ChildSpec, Supervisor
from tests.support.waiting import wait_until


def python_child(name: str, code: str) -> ChildSpec:
    return ChildSpec(name=name, argv=[sys.executable, "-u", "-c", textwrap.dedent(code)])


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


SLEEPER = """
    import time
    print("ready", flush=True)
    time.sleep(60)
"""


def test_stop_all_terminates_every_child_and_frees_logs(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path / "logs")
    children = [supervisor.start(python_child(f"c{i}", SLEEPER)) for i in range(3)]
    wait_until(lambda: all("ready" in c.last_lines() for c in children), within=10)

    started = time.monotonic()
    killed = supervisor.stop_all(timeout=4)

    assert killed == []
    assert time.monotonic() - started < 5
    assert not any(pid_alive(c.pid) for c in children)
    assert [c.process.returncode for c in children] == [-signal.SIGTERM] * 3
    assert supervisor.first_exited() is None  # stopped on purpose: not a death to report


def test_child_ignoring_sigterm_is_killed_after_the_timeout(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path)
    stubborn = supervisor.start(python_child("stubborn", """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ignoring", flush=True)
        time.sleep(60)
    """))
    polite = supervisor.start(python_child("polite", SLEEPER))
    wait_until(lambda: "ignoring" in stubborn.last_lines() and "ready" in polite.last_lines(),
               within=10)

    started = time.monotonic()
    killed = supervisor.stop_all(timeout=1)

    assert killed == ["stubborn"]
    assert 1 <= time.monotonic() - started < 5
    assert stubborn.process.returncode == -signal.SIGKILL
    assert not pid_alive(stubborn.pid) and not pid_alive(polite.pid)


def test_stop_all_reaches_grandchildren_in_the_childs_group(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path)
    parent = supervisor.start(python_child("parent", """
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print("grandchild", child.pid, flush=True)
        time.sleep(60)
    """))
    wait_until(lambda: any(line.startswith("grandchild") for line in parent.last_lines()),
               within=10)
    grandchild = int(next(line for line in parent.last_lines()
                          if line.startswith("grandchild")).split()[1])
    assert pid_alive(grandchild)

    supervisor.stop_all(timeout=4)

    wait_until(lambda: not pid_alive(grandchild), within=3, what="grandchild gone")
    assert not parent.group_alive()


def test_a_dead_child_is_reported_with_its_exit_code_and_last_log_lines(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path)
    healthy = supervisor.start(python_child("healthy", SLEEPER))
    dying = supervisor.start(python_child("dying", """
        import sys
        for i in range(30):
            print(f"line {i}")
        print("fatal: cannot bind port", file=sys.stderr)
        sys.exit(3)
    """))
    wait_until(lambda: supervisor.first_exited() is not None, within=10)

    assert supervisor.first_exited() is dying
    report = dying.describe_exit(lines=5)
    assert report.startswith(f"dying (pid {dying.pid}) exited with code 3 after ")
    assert report.splitlines()[1:] == [
        "    line 26", "    line 27", "    line 28", "    line 29",
        "    fatal: cannot bind port",
    ]
    assert str(dying.log_path) in report
    assert not healthy.exited()
    supervisor.stop_all()


def test_a_child_killed_by_a_signal_is_reported_as_such(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path)
    victim = supervisor.start(python_child("victim", SLEEPER))
    wait_until(lambda: "ready" in victim.last_lines(), within=10)
    os.kill(victim.pid, signal.SIGKILL)
    wait_until(lambda: supervisor.first_exited() is victim, within=5)
    assert "was killed by SIGKILL" in victim.describe_exit()
    supervisor.stop_all()


def test_pump_logs_interleaves_prefixed_lines_and_flushes_partial_ones(tmp_path: Path) -> None:
    echoed: list[str] = []
    supervisor = Supervisor(tmp_path, echo=echoed.append)
    a = supervisor.start(python_child("alpha", """
        print("one"); print("two")
    """))
    b = supervisor.start(python_child("registry", """
        import sys
        sys.stdout.write("no newline at the end")
    """))
    wait_until(lambda: a.exited() and b.exited(), within=10)

    supervisor.pump_logs()
    assert echoed == ["alpha    | one", "alpha    | two"]
    supervisor.pump_logs(final=True)
    assert echoed[2:] == ["registry | no newline at the end"]
    supervisor.pump_logs(final=True)
    assert len(echoed) == 3  # nothing is echoed twice


def test_names_must_be_unique(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path)
    supervisor.start(python_child("same", SLEEPER))
    with pytest.raises(ValueError, match="same"):
        supervisor.start(python_child("same", SLEEPER))
    supervisor.stop_all()


def test_children_die_with_a_supervisor_killed_by_sigkill(tmp_path: Path) -> None:
    """Even a ``lig up`` killed without a chance to clean up leaves no orphan behind."""
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from lig.supervisor import ChildSpec, Supervisor
        supervisor = Supervisor(Path({str(tmp_path)!r}))
        child = supervisor.start(ChildSpec("orphan", [sys.executable, "-c",
                                 "import time; time.sleep(60)"]))
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).parents[1])
    try:
        assert holder.stdout is not None
        orphan = int(holder.stdout.readline())
        assert pid_alive(orphan)
        holder.kill()
        holder.wait()
        wait_until(lambda: not pid_alive(orphan), within=5, what="child of a killed supervisor")
    finally:
        holder.kill()


def test_restart_starts_an_exited_child_again_appending_to_its_log(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path / "logs")
    first = supervisor.start(python_child("c", SLEEPER))
    wait_until(lambda: "ready" in first.last_lines(), within=10)
    with pytest.raises(ValueError, match="still running"):
        supervisor.restart("c")

    first.stopping = True
    first.signal_group(signal.SIGKILL)
    first.process.wait(5)
    second = supervisor.restart("c")
    try:
        wait_until(lambda: second.last_lines().count("ready") == 2, within=10)
        assert second.pid != first.pid and second.log_path == first.log_path
        assert supervisor.children == [second] and supervisor.first_exited() is None
    finally:
        assert supervisor.stop_all(timeout=4) == []
    assert not pid_alive(second.pid)
