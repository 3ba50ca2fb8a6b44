"""The ``process`` marker: which tests are process-level (real NATS, Envoy, subprocesses, sockets)
and which are unit tests (``make test-unit`` runs only the latter: ``pytest -m "not process"``).

Nobody has to remember the marker. A test is marked ``process`` when it
- uses a fixture defined in a process-level support module (``nats_server``, ``envoy_gateway``,
  ``simulated_pods``, ... and any fixture built on one), or
- sits in a module that imports from a process-level module (``subprocess``, ``socket``, ``grpc``,
  ``nats``, ``tests.support.nats_server``, ...: see ``PROCESS_MODULES``), or
- is marked by hand (``@pytest.mark.process`` or ``pytestmark``) for what neither shows.

Every other test is a unit test, and is held to it: opening a socket or starting a process
fails it, so a process-level test cannot be counted as a unit test without anyone noticing.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import types
from collections.abc import Iterator
from typing import Any

import pytest

MARKER = "process"
_ATTEMPTS = pytest.StashKey[list[str]]()
# Importing any of these (or a name defined in them) makes a test module process-level.
PROCESS_MODULES = (
    "subprocess",
    "socket",
    "multiprocessing",
    "venv",
    "grpc",
    "nats",
    "tests.support.certs",
    "tests.support.collector",
    "tests.support.envoy",
    "tests.support.ext_proc_client",
    "tests.support.fleet_feed",
    "tests.support.http2_peer",
    "tests.support.kube_apiserver",
    "tests.support.lig_up",
    "tests.support.metrics_pages",
    "tests.support.nats_cluster",
    "tests.support.nats_server",
    "tests.support.nats_sync",
    "tests.support.picker",
    "tests.support.ports",
    "tests.support.processes",
    "tests.support.registry_burst",
    "tests.support.simulator",
    "tests.support.upstream",
)
# Fixtures defined in these modules start servers or processes.
PROCESS_FIXTURE_MODULES = tuple(m for m in PROCESS_MODULES if m.startswith("tests.support."))


def _is_process_module(name: str | None) -> bool:
    return name is not None and any(name == m or name.startswith(m + ".") for m in PROCESS_MODULES)


def imports_process_module(module: types.ModuleType) -> bool:
    """Whether ``module`` holds a process-level module, or a name defined in one."""
    for value in vars(module).values():
        if isinstance(value, types.ModuleType):
            origin: str | None = value.__name__
        else:
            origin = getattr(value, "__module__", None)
            if not isinstance(origin, str):
                continue
        if _is_process_module(origin):
            return True
    return False


def uses_process_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` (directly or through other fixtures) uses a process-level fixture."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for definitions in info.name2fixturedefs.values():
        for definition in definitions:
            if getattr(definition.func, "__module__", "").startswith(PROCESS_FIXTURE_MODULES):
                return True
    return False


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker (pyproject registers it too; this keeps the plugin self-contained)."""
    config.addinivalue_line("markers", f"{MARKER}: process-level test (see {__name__})")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Do before any test what a library does once per machine by starting a process, so a
    unit test sees the same state on a new machine as on one that ran the suite before.

    matplotlib builds its font cache (``~/.cache/matplotlib``, or ``MPLCONFIGDIR``) on the first
    import of its font manager and runs ``fc-list`` for it: the first plot of a unit test on a
    new machine (every CI run) was refused as "starting a process".
    """
    with contextlib.suppress(ImportError):  # no [bench] extra installed: no test plots
        import matplotlib.font_manager  # noqa: F401 - imported for the cache it builds


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark process-level tests; run at collection, so ``-m "not process"`` sees the marks."""
    by_module: dict[str, bool] = {}
    for item in items:
        if item.get_closest_marker(MARKER) is not None:
            continue
        module = getattr(item, "module", None)
        in_process_module = False
        if module is not None:
            if module.__name__ not in by_module:
                by_module[module.__name__] = imports_process_module(module)
            in_process_module = by_module[module.__name__]
        if in_process_module or uses_process_fixture(item):
            item.add_marker(MARKER)


@pytest.fixture(autouse=True)
def _unit_tests_stay_in_process(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """In a test not marked ``process``, refuse sockets that reach out and new processes."""
    if request.node.get_closest_marker(MARKER) is not None:
        yield
        return
    attempts = request.node.stash[_ATTEMPTS] = []

    def refuse(what: str) -> Any:
        def refused(*args: Any, **kwargs: Any) -> Any:
            attempts.append(what)
            raise ProcessInUnitTest(_message(attempts))
        return refused

    # Not bind: libraries probe with it at import (urllib3 binds ::1 to detect IPv6).
    for method in ("connect", "connect_ex", "listen"):
        monkeypatch.setattr(socket.socket, method, refuse(f"socket.{method}"))
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse("starting a process"))
    monkeypatch.setattr(os, "fork", refuse("os.fork"))
    monkeypatch.setattr(os, "posix_spawn", refuse("os.posix_spawn"))
    yield
    if attempts:  # in the fixtures' setup or teardown (the test's own call is checked below)
        pytest.fail(_message(attempts), pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Fail a unit test that tried, even when the code under test caught the error."""
    result = yield
    attempts = item.stash.get(_ATTEMPTS, None)
    if attempts:
        message = _message(attempts)
        attempts.clear()
        pytest.fail(message, pytrace=False)
    return result


def _message(attempts: list[str]) -> str:
    return (f"{', '.join(sorted(set(attempts)))} in a test not marked {MARKER!r}: "
            f"mark it @pytest.mark.{MARKER} (see {__name__})")


class ProcessInUnitTest(OSError):
    """A unit test tried to open a socket or start a process."""
