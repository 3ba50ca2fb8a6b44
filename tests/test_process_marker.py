"""The ``process`` marker (tests/support/process_marker.py): process-level tests are marked without
anyone remembering to, and a unit test that reaches for a socket or a process fails."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FIXTURES = '''
import pytest

@pytest.fixture
def built_on_nats(nats_server):
    return nats_server
'''

PURE = '''
import pytest

def test_pure():
    assert sum([1, 2]) == 3

def test_uses_the_nats_fixture(nats_server):
    pass

def test_uses_a_fixture_built_on_it(built_on_nats):
    pass

@pytest.mark.process
def test_marked_by_hand():
    pass
'''

IMPORTS_A_PROCESS_HELPER = '''
from tests.support.nats_server import NatsServer

def test_in_a_module_that_starts_nats():
    assert NatsServer
'''

IMPORTS_SUBPROCESS = '''
import subprocess

def test_in_a_module_that_runs_commands():
    assert subprocess
'''

REACHES_OUT = '''
import asyncio
import importlib

def test_starts_a_process_without_importing_subprocess_here():
    try:
        importlib.import_module("subprocess").run(["true"], check=False)
    except OSError:
        pass  # swallowed by the code under test: the attempt still fails the test

async def test_connects_a_socket():
    try:
        await asyncio.open_connection("127.0.0.1", 9)
    except OSError:
        pass

def test_stays_in_process():
    assert sorted([3, 1, 2]) == [1, 2, 3]
'''


PLOTS = '''
import matplotlib

def test_plots_a_figure(tmp_path):
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.plot([1, 2])
    plt.savefig(tmp_path / "plot.png")
'''


def run_pytest(directory: Path, *args: str,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """pytest on ``directory`` with this project's marker plugin and NATS fixtures loaded."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.support.process_marker",
         "-p", "tests.support.nats_server", "-p", "no:cacheprovider", "--strict-markers",
         "-o", "asyncio_mode=auto", "-o", "addopts=", "--rootdir", str(directory), *args,
         str(directory)],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env)


def write(directory: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (directory / name).write_text(textwrap.dedent(text))


def collected(directory: Path, expression: str) -> set[str]:
    result = run_pytest(directory, "--collect-only", "-q", "-m", expression)
    assert result.returncode == 0, result.stdout + result.stderr
    return {line.split("::")[1] for line in result.stdout.splitlines() if "::" in line}


def test_process_tests_are_marked_by_fixture_import_or_hand(tmp_path: Path) -> None:
    write(tmp_path, {"conftest.py": FIXTURES, "test_pure.py": PURE,
                     "test_helper.py": IMPORTS_A_PROCESS_HELPER,
                     "test_commands.py": IMPORTS_SUBPROCESS})
    assert collected(tmp_path, "process") == {
        "test_uses_the_nats_fixture", "test_uses_a_fixture_built_on_it", "test_marked_by_hand",
        "test_in_a_module_that_starts_nats", "test_in_a_module_that_runs_commands"}
    assert collected(tmp_path, "not process") == {"test_pure"}


def test_a_unit_test_that_reaches_out_fails_naming_the_marker(tmp_path: Path) -> None:
    write(tmp_path, {"test_reaches_out.py": REACHES_OUT})
    result = run_pytest(tmp_path, "-q", "-m", "not process")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "2 failed, 1 passed" in result.stdout, result.stdout
    assert "starting a process in a test not marked 'process'" in result.stdout
    assert "socket.connect in a test not marked 'process'" in result.stdout
    assert "mark it @pytest.mark.process" in result.stdout


def test_a_unit_test_plots_on_a_machine_that_never_plotted(tmp_path: Path) -> None:
    """matplotlib's first import on a machine builds its font cache with ``fc-list`` (a
    process); the session does that before the unit tests' sandbox, so a new CI machine passes
    like a warm one. Here a fresh ``MPLCONFIGDIR`` stands for the new machine."""
    tests = tmp_path / "tests"
    tests.mkdir()
    write(tests, {"test_plots.py": PLOTS})
    config = tmp_path / "matplotlib-config"
    result = run_pytest(tests, "-q", "-m", "not process",
                        env={**os.environ, "MPLCONFIGDIR": str(config)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout, result.stdout
    assert list(config.glob("fontlist-*.json")), "the font cache was not built"
