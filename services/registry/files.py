"""The file source of the registry: YAML files and folders read into :class:`Document`s.

A path may be a file or a folder; a folder contributes its ``*.yaml`` and ``*.yml`` files (not
recursive, like ``kubectl apply -f DIR``; hidden files are skipped), in name order. A named path
that does not exist is a problem rather than an empty input, so that a typo or a missing mount
cannot wipe the published registry. An empty folder is a valid, empty registry.

Reading is separate from parsing so that the watcher can compare raw contents cheaply
(:func:`read_files`) and parse only when something changed (:func:`load`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec
import yaml

from services.registry.loader import Document, Problem, Registry, build_registry

YAML_SUFFIXES = (".yaml", ".yml")


class SourceFile(msgspec.Struct, frozen=True):
    """One input file's path and text."""

    path: str
    text: str


class FileSnapshot(msgspec.Struct, frozen=True):
    """Everything read from the inputs at one moment; equal snapshots parse to equal results."""

    files: tuple[SourceFile, ...] = ()
    problems: tuple[Problem, ...] = ()


def read_files(paths: Sequence[str]) -> FileSnapshot:
    """Read every input file named by ``paths`` (files or folders)."""
    files: list[SourceFile] = []
    problems: list[Problem] = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            candidates = sorted(
                p for p in path.iterdir()
                if p.suffix in YAML_SUFFIXES and not p.name.startswith(".") and p.is_file()
            )
            explicit = False
        else:
            candidates = [path]
            explicit = True
        for candidate in candidates:
            try:
                files.append(SourceFile(str(candidate), candidate.read_bytes().decode()))
            except FileNotFoundError:
                # A folder entry deleted since the listing is simply gone; a named file is missing.
                if explicit:
                    problems.append(Problem(str(candidate), "no such file or folder"))
            except UnicodeDecodeError as exc:
                problems.append(Problem(str(candidate), f"not UTF-8 text: {exc.reason}"))
            except OSError as exc:
                problems.append(Problem(str(candidate), f"cannot read: {exc.strerror or exc}"))
    return FileSnapshot(tuple(files), tuple(problems))


def parse(snapshot: FileSnapshot) -> tuple[list[Document], list[Problem]]:
    """Split every file into its YAML documents; syntax errors become problems."""
    documents: list[Document] = []
    problems = list(snapshot.problems)
    for source in snapshot.files:
        loader = yaml.SafeLoader(source.text)
        index = 0  # 1-based number of the document being read, for problems
        try:
            while True:
                index += 1
                if not loader.check_node():
                    break
                node = loader.get_node()
                lines: dict[str, int] = {}
                found = list(_index_lines(node, "", node.start_mark.line + 1, lines, set(), set()))
                if found:
                    problems += [Problem(source.path, message, index, line, field or None)
                                 for field, message, line in found]
                    continue
                data = loader.construct_document(node)
                if data is not None:  # an empty document (a stray ---) holds nothing
                    documents.append(Document(source.path, index, data, lines))
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            reason = getattr(exc, "problem", None) or str(exc)
            problems.append(Problem(source.path, f"invalid YAML: {reason}", index,
                                    mark.line + 1 if mark is not None else None))
        finally:
            loader.dispose()
    return documents, problems


def load(snapshot: FileSnapshot) -> Registry:
    """Parse and validate ``snapshot``; raise :class:`InvalidRegistry` listing every problem."""
    documents, problems = parse(snapshot)
    return build_registry(documents, problems)


def _index_lines(
    node: yaml.Node, path: str, line: int, lines: dict[str, int], ancestors: set[int],
    done: set[int],
) -> Iterator[tuple[str, str, int]]:
    """Record the line of every field path under ``node``; yield ``(field, message, line)`` for
    duplicate mapping keys and self-containing aliases (which would recurse forever later).

    Paths use the notation of msgspec errors (``spec.targetModels[1].weight``) so that a
    validation error can be traced back to its line (a field's line is its key's line).
    """
    lines[path] = line
    if id(node) in ancestors:
        yield path, "an alias may not refer to a node that contains it", line
        return
    if id(node) in done:  # an alias of a node walked before: once is enough (and stays linear)
        return
    ancestors.add(id(node))
    if isinstance(node, yaml.MappingNode):
        keys: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            child = f"{path}.{key}" if path else key
            key_line = key_node.start_mark.line + 1
            if key in keys:
                yield child, "duplicate key", key_line
            keys.add(key)
            yield from _index_lines(value_node, child, key_line, lines, ancestors, done)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _index_lines(item, f"{path}[{i}]", item.start_mark.line + 1, lines,
                                    ancestors, done)
    ancestors.discard(id(node))
    done.add(id(node))
