"""The import graph's shape, read from the source with ``ast`` (nothing is imported).

- The layers the services ship (``protocols``, ``scheduling``, ``shared``, ``services``) import
  none of the tools built on them: a production picker must not load simulator, benchmark or
  CLI code; and the protocol code imports no service, scheduling or tool code.
- No import cycle among the project's modules, nor among its top-level packages. Imports inside
  functions and ``if TYPE_CHECKING:`` blocks count too: deferring an import hides a cycle from
  the interpreter, not from the reader.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Every top-level directory that is a package, plus bench/ (scripts that import each other as
# ``bench.*`` without an __init__.py).
PACKAGES = tuple(sorted(
    {path.parent.name for path in ROOT.glob("*/__init__.py")} | {"bench"}))
LOWER_LAYERS = ("protocols", "scheduling", "shared", "services")
TOOLS = ("simulator", "scheduling_bench", "lig", "resilience", "bench", "recording")


def _module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every first-party module (a package by its __init__)."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


MODULES = _module_files()


def _imported_names(module: str, path: Path) -> Iterator[str]:
    """Every dotted name the module imports, anywhere in it; relative imports made absolute and
    ``from a import b`` given as both ``a`` and ``a.b`` (``b`` may be a module)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            yield source
            yield from (f"{source}.{alias.name}" for alias in node.names)


def _first_party(name: str) -> str | None:
    """The first-party module a dotted name lives in (its longest known prefix), if any."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
def _import_graph() -> dict[str, set[str]]:
    """First-party module -> the first-party modules it imports."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = {_first_party(name) for name in _imported_names(module, path)}
        graph[module] = {target for target in targets if target and target != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per back edge a depth-first search meets, as the path that closes it."""
    cycles: list[list[str]] = []
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        while stack:
            target = next(stack[-1], None)
            if target is None:
                stack.pop()
                done.add(path.pop())
            elif target in path:
                cycles.append([*path[path.index(target):], target])
            elif target not in done:
                path.append(target)
                stack.append(iter(sorted(graph[target])))
    return cycles


def test_lower_layers_import_no_tool() -> None:
    """protocols/, scheduling/, shared/ and services/ ship in every picker, collector and
    registry; the tools (CLI, simulator, benches, recording, attack tools) are built on them,
    never under."""
    upward = [
        f"{module} imports {name}"
        for module, path in sorted(MODULES.items()) if module.split(".")[0] in LOWER_LAYERS
        for name in sorted(set(_imported_names(module, path))) if name.split(".")[0] in TOOLS
    ]
    assert upward == []


def test_protocols_import_only_shared() -> None:
    """protocols/ is the wire level: the services use it, never the other way round."""
    allowed = ("protocols", "shared")
    reaching = [f"{module} imports {target}"
                for module, targets in sorted(_import_graph().items())
                if module.split(".")[0] == "protocols"
                for target in sorted(targets) if target.split(".")[0] not in allowed]
    assert reaching == []


def test_no_import_cycle_among_modules() -> None:
    cycles = [" -> ".join(cycle) for cycle in _cycles(_import_graph())]
    assert cycles == []


def _layer(module: str) -> str:
    """The package a module belongs to for layering: its top-level package, except that
    tests/support (the fixtures library the suites and the benches import) stands apart from
    the suites (which test the benches)."""
    return "tests.support" if module.startswith("tests.support") else module.split(".")[0]


def test_no_import_cycle_among_packages() -> None:
    """The top-level packages form layers: no two import each other, even through others."""
    layers: dict[str, set[str]] = {}
    for module, targets in _import_graph().items():
        layer = _layer(module)
        layers.setdefault(layer, set()).update({_layer(target) for target in targets} - {layer})
    cycles = [" -> ".join(cycle) for cycle in _cycles(layers)]
    assert cycles == []


def test_the_checks_see_the_graph() -> None:
    """The graph is read at all: known edges are found, and a known cycle would be reported."""
    graph = _import_graph()
    assert "lig.explain_output" in graph["lig.explain"]
    assert "scheduling.lig_sim_tokenizer" in graph["scheduling.prompt_tokenizers"]
    assert "services.picker.routing" in graph["services.picker.core"]
    assert "protocols.http2" in graph["services.picker.app"]
    assert {"tests", "lig", "protocols", "scheduling", "bench"} <= set(PACKAGES)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
