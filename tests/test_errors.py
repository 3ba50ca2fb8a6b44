"""One error hierarchy (``shared.errors``), turned into one line and an exit code by ``lig``."""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import sys
import types

import pytest

from lig import cli
from shared.errors import ConfigError, ExitCode, InputError, LigError

# The packages in the wheel; their __main__ modules run a tool when imported.
PACKAGES = ("envoy_bootstrap", "lig", "recording", "resilience", "scheduling", "scheduling_bench",
            "services", "shared", "simulator")


def _project_exceptions() -> list[type[BaseException]]:
    found: list[type[BaseException]] = []
    for package in PACKAGES:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if info.name.rpartition(".")[2] == "__main__":
                continue
            module = importlib.import_module(info.name)
            found.extend(value for value in vars(module).values()
                         if inspect.isclass(value) and issubclass(value, BaseException)
                         and value.__module__ == module.__name__)
    return found


def test_every_project_exception_is_a_lig_error() -> None:
    classes = _project_exceptions()
    assert len(classes) >= 30  # the walk found them
    outside = [f"{cls.__module__}.{cls.__qualname__}" for cls in classes
               if not issubclass(cls, LigError)]
    assert outside == []


def test_every_exit_code_is_in_the_table() -> None:
    codes = {cls.exit_code for cls in _project_exceptions() if issubclass(cls, LigError)}
    assert codes <= set(ExitCode)
    assert (ConfigError.exit_code, InputError.exit_code, LigError.exit_code) == (2, 2, 1)


class _Refused(LigError):
    """A stand-in error of a command."""


@pytest.mark.parametrize(("error", "code"), [
    (ConfigError("--flag must be > 0"), 2),
    (InputError("file.json: not valid JSON"), 2),
    (_Refused("no such thing"), 1),
])
def test_the_cli_prints_one_line_and_the_class_exit_code(
        error: LigError, code: int, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    command = types.ModuleType("tests_fake_command")

    def run(args: argparse.Namespace) -> int:
        raise error

    command.configure = lambda parser: None  # type: ignore[attr-defined]
    command.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, command.__name__, command)
    monkeypatch.setitem(cli.COMMANDS, "fake", (command.__name__, "a command that fails"))
    assert cli.main(["fake"]) == code
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"lig fake: error: {error}\n")
