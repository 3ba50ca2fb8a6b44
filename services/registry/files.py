"""The file source of the registry: YAML files and folders read into :class:`Document`s.

A path may be a file or a folder; a folder contributes its ``*.yaml`` and ``*.yml`` files (not
recursive, like ``kubectl apply -f DIR``; hidden files are skipped), in name order. A named path
that does not exist is a problem rather than an empty input, so that a typo or a missing mount
cannot wipe the published registry. An empty folder is a valid, empty registry (whether it may
replace a published one is the reconciler's decision).

Input is bounded so that no file can crash the registry or exhaust its memory: at most
:data:`MAX_FILE_BYTES` per file and :data:`MAX_TOTAL_BYTES` in all, nesting at most
:data:`MAX_DEPTH` levels deep and at most :data:`MAX_VALUES` values per document, both counted with
aliases expanded (a "billion laughs" document of anchors and aliases is refused before anything
expands it), and values a YAML tag cannot convert (a 5,000-digit integer, a 13th month) are
problems rather than exceptions. Parsing uses libyaml's event parser when PyYAML has it (about
five times faster: 10,000 models in about 1.5 s of CPU), PyYAML's own otherwise; nodes are composed
here either way, which is where the limits are enforced.

Reading is separate from parsing so that the watcher can compare raw contents cheaply
(:func:`read_files`) and parse only when something changed (:func:`load`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import msgspec
import yaml

from services.registry.loader import Document, Problem, Registry, build_registry
from shared.errors import LigError

if TYPE_CHECKING:  # libyaml's own Mark class, absent from PyYAML built without libyaml
    from yaml._yaml import Mark as LibyamlMark

# Where an event starts: each parser has its own Mark class (types-PyYAML allows None too).
_Mark: TypeAlias = "yaml.Mark | LibyamlMark | None"

YAML_SUFFIXES = (".yaml", ".yml")
MAX_FILE_BYTES = 16 * 1024 * 1024
MAX_TOTAL_BYTES = 64 * 1024 * 1024
# The objects nest about six levels (spec.endpoints[0].labels.app); kubectl output with
# managedFields about fifteen. PyYAML composes recursively, about three frames per level.
MAX_DEPTH = 64
# A pool of 10,000 endpoints is about 110,000 values.
MAX_VALUES = 1_000_000
_FIELD_SEGMENTS_SHOWN = 8  # of a field path in a "nested too deeply" problem


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
    budget = MAX_TOTAL_BYTES
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
                data = _read_at_most(candidate, min(MAX_FILE_BYTES, budget) + 1)
                if len(data) > MAX_FILE_BYTES:
                    problems.append(Problem(str(candidate), f"larger than the limit of "
                                            f"{MAX_FILE_BYTES // 2**20} MiB per file"))
                elif len(data) > budget:
                    problems.append(Problem(str(candidate), f"the inputs are larger than the "
                                            f"limit of {MAX_TOTAL_BYTES // 2**20} MiB in all"))
                else:
                    budget -= len(data)
                    files.append(SourceFile(str(candidate), data.decode()))
            except FileNotFoundError:
                # A folder entry deleted since the listing is simply gone; a named file is missing.
                if explicit:
                    problems.append(Problem(str(candidate), "no such file or folder"))
            except UnicodeDecodeError as exc:
                problems.append(Problem(str(candidate), f"not UTF-8 text: {exc.reason}"))
            except OSError as exc:
                problems.append(Problem(str(candidate), f"cannot read: {exc.strerror or exc}"))
    return FileSnapshot(tuple(files), tuple(problems))


def _read_at_most(path: Path, limit: int) -> bytes:
    """The first ``limit`` bytes of ``path`` (so a huge file is never read whole)."""
    with path.open("rb") as stream:
        return stream.read(limit)


class LoadCancelled(LigError):
    """Loading was given up on request (the registry is stopping)."""


def parse(snapshot: FileSnapshot, cancelled: Callable[[], bool] = lambda: False,
          ) -> tuple[list[Document], list[Problem]]:
    """Split every file into its YAML documents; syntax errors become problems.

    ``cancelled`` is asked before each document: when it says True, :class:`LoadCancelled` is
    raised (inputs within the size limits can take minutes: a million empty documents).
    """
    documents: list[Document] = []
    problems = list(snapshot.problems)
    for source in snapshot.files:
        unprintable = _NON_PRINTABLE.search(source.text)
        if unprintable:
            line = source.text.count("\n", 0, unprintable.start()) + 1
            problems.append(Problem(source.path, f"invalid YAML: unacceptable character "
                                    f"#x{ord(unprintable[0]):04x} at position "
                                    f"{unprintable.start()}", line=line))
            continue
        index = 0  # 1-based number of the document being read, for problems
        loader = _loader(source.text)
        try:
            while True:
                index += 1
                if cancelled():
                    raise LoadCancelled
                node = loader.get_node() if loader.check_node() else None
                if node is None:
                    break
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
                                    mark.line + 1 if mark is not None else None,
                                    getattr(exc, "field", None)))
        finally:
            loader.dispose()
    return documents, problems


class _FieldError(LigError, yaml.MarkedYAMLError):
    """A document over one of this module's limits, or a value its tag cannot convert, at
    ``field`` (a path in the notation of the problems)."""

    def __init__(self, message: str, mark: _Mark, field: str | None) -> None:
        # types-PyYAML allows only yaml.Mark, but libyaml's parser raises these with its own.
        super().__init__(None, None, message, mark)  # type: ignore[arg-type]
        self.field = field or None


# Characters YAML 1.1 does not allow in a stream (PyYAML's Reader rejects the same); checked
# before parsing, so that both parsers below report them alike, with a character offset.
_NON_PRINTABLE = re.compile("[^\x09\x0A\x0D\x20-\x7E\x85\xA0-\uD7FF\uE000-\uFFFD"
                            "\U00010000-\U0010FFFF]")


class _BoundedLoader(yaml.composer.Composer, yaml.constructor.SafeConstructor,
                     yaml.resolver.Resolver):
    """PyYAML's safe loading with the limits of this module, raising YAML errors with a line;
    the events come from a parser class mixed in after it (:data:`LOADERS`).

    Every composed node's size and depth are measured with aliases expanded, from its children's
    measures (an alias refers to a node composed before it), so the check is linear in the text.
    """

    # Supplied by the parser class mixed in after this one (annotations only: a method defined
    # here would shadow the parser's).
    peek_event: Callable[[], yaml.Event]
    dispose: Callable[[], None]

    def __init__(self, text: str) -> None:
        self._start_parser(text)
        yaml.composer.Composer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)
        self._path: list[str] = []  # field path of the node being composed
        self._measures: dict[yaml.Node, tuple[int, int]] = {}  # node -> (values, depth)
        self._fields: dict[yaml.Node, str] = {}  # node -> its field path, for problems

    def _start_parser(self, text: str) -> None:
        """Start the event parser mixed in by a subclass on ``text``."""
        raise NotImplementedError

    def compose_document(self) -> yaml.Node | None:
        self._measures.clear()  # aliases cannot cross documents
        self._fields.clear()
        return super().compose_document()

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        mark = self.peek_event().start_mark
        if isinstance(index, yaml.ScalarNode):  # a mapping value: index is its key
            self._path.append(f".{index.value}" if any(self._path) else str(index.value))
        elif isinstance(index, int):  # a sequence item
            self._path.append(f"[{index}]")
        else:  # the root, or a mapping key (reported at its mapping)
            self._path.append("")
        try:
            if len(self._path) > MAX_DEPTH:
                raise self._exceeded(f"nested deeper than {MAX_DEPTH} levels", mark)
            # types-PyYAML is wrong twice here: ``index`` is an int only for a sequence item
            # (PyYAML passes a mapping value's key node, None for the root), and the result is
            # never None (a node, or an error).
            node: yaml.Node = super().compose_node(parent, index)  # type: ignore[arg-type,assignment]
            if node not in self._measures:  # not an alias of a node measured before
                self._measures[node] = self._measure(node, mark)
                self._fields[node] = "".join(self._path)
        finally:
            self._path.pop()
        return node

    def _measure(self, node: yaml.Node, mark: _Mark) -> tuple[int, int]:
        if isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            return 1, 1
        # An alias of an ancestor has no measure yet; _index_lines reports it.
        measures = [self._measures.get(child, (1, 1)) for child in children]
        values = 1 + sum(size for size, _ in measures)
        depth = 1 + max((deep for _, deep in measures), default=0)
        if depth > MAX_DEPTH:
            raise self._exceeded(f"nested deeper than {MAX_DEPTH} levels (aliases expanded)",
                                 mark)
        if values > MAX_VALUES:
            raise self._exceeded(f"more than {MAX_VALUES:,} values in one document (aliases "
                                 "expanded)", mark)
        return values, depth

    def _exceeded(self, message: str, mark: _Mark) -> _FieldError:
        segments = [segment for segment in self._path if segment]
        shown = segments[:_FIELD_SEGMENTS_SHOWN]
        more = "..." if len(segments) > len(shown) else ""
        return _FieldError(message, mark, "".join(shown) + more)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except Exception as exc:
            # PyYAML's constructors trust the scalars an explicit tag hands them: an integer of
            # more than 4,300 digits, a date in month 13, `!!int abc` or an empty `!!timestamp`
            # raise ValueError, IndexError, AttributeError... Each is that value's problem.
            kind = node.tag.rsplit(":", 1)[-1]
            raise _FieldError(f"cannot read {kind} value: {exc}", node.start_mark,
                              self._fields.get(node)) from exc


def load(snapshot: FileSnapshot, cancelled: Callable[[], bool] = lambda: False) -> Registry:
    """Parse and validate ``snapshot``; raise :class:`InvalidRegistry` listing every problem
    (or :class:`LoadCancelled`, see :func:`parse`)."""
    documents, problems = parse(snapshot, cancelled)
    return build_registry(documents, problems)


class _PythonLoader(_BoundedLoader, yaml.reader.Reader, yaml.scanner.Scanner,
                    yaml.parser.Parser):
    """Events from PyYAML's own scanner and parser."""

    def _start_parser(self, text: str) -> None:
        yaml.reader.Reader.__init__(self, text)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)


# By parser: libyaml's (when PyYAML was built with it, as its wheels are) is about five times
# faster than PyYAML's own and iterative; composing nodes stays in Python either way, where depth
# and size are bounded. The first is used.
LOADERS: dict[str, type[_BoundedLoader]] = {}
if yaml.__with_libyaml__:
    from yaml._yaml import CParser

    class _LibyamlLoader(_BoundedLoader, CParser):
        """Events from libyaml."""

        def _start_parser(self, text: str) -> None:
            CParser.__init__(self, text)

    LOADERS["libyaml"] = _LibyamlLoader
LOADERS["python"] = _PythonLoader
_loader = next(iter(LOADERS.values()))


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
