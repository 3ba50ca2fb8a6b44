"""Regenerate the reference sections of docs/reference.md from the code itself.

    python docs/render_reference.py           # rewrite them
    python docs/render_reference.py --check   # exit 1 if docs/reference.md is out of date

Sections between ``<!-- BEGIN GENERATED: NAME -->`` and ``<!-- END GENERATED: NAME -->``:
``commands`` (every ``lig`` command's real ``--help``), ``environment`` (the variables those help
texts name) and ``metrics`` (the Prometheus metrics each service registers).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prometheus_client import CollectorRegistry  # noqa: E402

from lig.cli import COMMANDS  # noqa: E402

REFERENCE = ROOT / "docs" / "reference.md"
HELP_WIDTH = "100"
# "env LIG_X", or "env LIG_X or OLDER_NAME" for a variable also read under an older name.
_ENV = re.compile(r"\benv\s+(LIG_[A-Z_]+(?:\s+or\s+[A-Z_]+)*)")


def command_help(command: str) -> str:
    """``lig <command> --help`` exactly as the CLI prints it, independent of this machine."""
    module_name, summary = COMMANDS[command]
    saved = {name: value for name, value in os.environ.items() if name.startswith("LIG_")}
    for name in saved:
        del os.environ[name]
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        parser = argparse.ArgumentParser(
            prog=f"lig {command}", description=summary,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        importlib.import_module(module_name).configure(parser)
        text = parser.format_help()
    finally:
        os.environ.update(saved)
    return text


def commands_section() -> str:
    parts = []
    for command in COMMANDS:
        parts.append(f"#### `lig {command}`\n\n```text\n{command_help(command).rstrip()}\n```")
    return "\n\n".join(parts)


def environment_section() -> str:
    readers: dict[str, list[str]] = {}
    for command in COMMANDS:
        found = _ENV.findall(command_help(command))
        for variable in sorted({name for names in found for name in names.split()
                                if name != "or"}):
            readers.setdefault(variable, []).append(f"`lig {command}`")
    rows = [f"| `{variable}` | {', '.join(commands)} |"
            for variable, commands in sorted(readers.items())]
    return "\n".join(["| variable | read by |", "|---|---|", *rows])


def _metric_registries() -> dict[str, Callable[[], CollectorRegistry]]:
    from services.collector.observability import CollectorMetrics
    from services.kvevents.observability import KVEventsMetrics
    from services.picker.observability import PickerMetrics
    from services.registry.metrics import RegistryMetrics

    def picker() -> CollectorRegistry:
        registry = CollectorRegistry()
        PickerMetrics(registry)
        return registry

    return {
        "lig picker (`--metrics-port`, 9090)": picker,
        "lig collector (`--metrics-port`, 9091)": lambda: CollectorMetrics().prometheus,
        "lig registry (`--metrics-port`, 9092)": lambda: RegistryMetrics().prometheus,
        "lig kv-events (`--metrics-port`, 9093)": lambda: KVEventsMetrics().prometheus,
    }


def metrics_section() -> str:
    parts = []
    for service, make_registry in _metric_registries().items():
        rows = ["| metric | type | meaning |", "|---|---|---|"]
        for family in make_registry().collect():
            name = f"{family.name}_total" if family.type == "counter" else family.name
            rows.append(f"| `{name}` | {family.type} | {family.documentation} |")
        parts.append(f"{service}:\n\n" + "\n".join(rows))
    return "\n\n".join(parts)


SECTIONS: dict[str, Callable[[], str]] = {
    "commands": commands_section,
    "environment": environment_section,
    "metrics": metrics_section,
}


def render(text: str) -> str:
    """``text`` with every generated section replaced by its current content."""
    for name, make in SECTIONS.items():
        pattern = re.compile(rf"(<!-- BEGIN GENERATED: {name} -->\n).*?(<!-- END GENERATED: "
                             rf"{name} -->)", re.DOTALL)
        if not pattern.search(text):
            raise ValueError(f"docs/reference.md has no generated section {name!r}")
        text = pattern.sub(partial(_fill, content=make()), text)
    return text


def _fill(match: re.Match[str], content: str) -> str:
    """A generated section (``match``: its two markers) holding ``content``."""
    return f"{match.group(1)}{content}\n{match.group(2)}"


def main() -> int:
    """Rewrite docs/reference.md, or with ``--check`` exit 1 when it is out of date."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if stale")
    args = parser.parse_args()
    current = REFERENCE.read_text()
    wanted = render(current)
    if args.check:
        if wanted != current:
            print("docs/reference.md is out of date: run python docs/render_reference.py",
                  file=sys.stderr)
            return 1
        return 0
    REFERENCE.write_text(wanted)
    print("wrote docs/reference.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
