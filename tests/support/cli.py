"""Parsing a ``lig`` command line the way ``lig`` does, for checks of deployment files."""

from __future__ import annotations

import argparse
import importlib
import os
from typing import Any

import pytest

from lig.cli import COMMANDS


def lig_parser(command: str, environment: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """The parser ``lig <command>`` builds, with only ``environment``'s ``LIG_*`` variables set
    while the command reads its defaults from the environment."""
    module_name, _ = COMMANDS[command]
    parser = argparse.ArgumentParser(prog=f"lig {command}", exit_on_error=False)
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("LIG_")]:
            patch.delenv(name)
        for name, value in (environment or {}).items():
            patch.setenv(name, value)
        importlib.import_module(module_name).configure(parser)
    return parser


def parse_command(argv: list[str], environment: dict[str, str] | None = None
                  ) -> tuple[str, Any]:
    """``(subcommand, configuration)`` of a ``lig`` command line, parsed by that command's
    parser: a service's settings Struct (flags, then ``environment``, then defaults), else
    the command's ``argparse`` namespace."""
    command, *flags = argv
    assert command in COMMANDS, f"{command!r} is not a lig command"
    parser = lig_parser(command, environment)
    try:
        args = parser.parse_args(flags)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise AssertionError(f"`lig {' '.join(argv)}` does not parse: {exc}") from exc
    module = importlib.import_module(COMMANDS[command][0])
    if not hasattr(module, "settings_from"):
        return command, args
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("LIG_")]:
            patch.delenv(name)
        for name, value in (environment or {}).items():
            patch.setenv(name, value)
        return command, module.settings_from(args)
