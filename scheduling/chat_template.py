"""A model's chat template (Jinja), rendered the way vLLM renders it for ``/v1/chat/completions``.

vLLM hands the template to Hugging Face transformers' ``apply_chat_template``, which renders it in
a sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter that keeps non-ASCII text, and the globals ``raise_exception`` and
``strftime_now``, and its ``{% generation %}`` tag; the variables are ``messages``,
``add_generation_prompt`` (true for a chat request), ``tools`` and ``documents`` (none: the
picker does not read them), and the tokenizer's special tokens (``bos_token``, ``eos_token``...,
``additional_special_tokens``) from ``tokenizer_config.json``. This module does the same, so
that the rendered text (then tokenized without adding special tokens, as vLLM does for chat)
gives the engine's token ids.

Where the template comes from (as transformers looks for it): a ``chat_template.jinja`` file beside
``tokenizer.json``, else the ``chat_template`` field of ``tokenizer_config.json`` (a string, or a
list of named templates of which ``default`` is taken).

The template is code from a model repository, run on the picker's event loop for every chat
request. Jinja's sandbox stops it reaching Python internals but not from spending memory or CPU
(``'x' * 10**9``, ``'%099999999d' % 1``, ``'x'|center(10**9)``, a string doubled in a loop by
``~``, ``+`` or ``join``, nested ``range`` loops), so each render is bounded here: its output and
any string, list or number it builds stay under :data:`MAX_RENDERED_CHARS` (repeats, sums,
concatenations, joins, replaces, widths and counts are checked before they are built; what a
filter or method returns, after), and it may take :data:`MAX_RENDER_STEPS` steps (attribute and
item reads, calls, operators, concatenations, items of ``range``). A render over a bound raises
``jinja2.exceptions.SecurityError`` like any template error: the request falls back to the
approximate index. Not bounded: loops nested over the request's own lists (``messages`` within
``messages``) that do nothing in their body, which cost the square of the request's size and no
step.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.exceptions
import jinja2.ext
import jinja2.filters
import jinja2.nodes
import jinja2.sandbox

from shared.errors import LigError

# The tokenizer_config.json fields a template may read as variables.
_SPECIAL_TOKEN_FIELDS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                         "cls_token", "mask_token")


MAX_RENDERED_CHARS = 32 * 1024 * 1024
"""The longest text one render may produce or build (the gateway's request body bound, 32 MiB:
a longer prompt could not have been sent)."""
MAX_RENDER_STEPS = 1_000_000
"""Steps one render may take (about a second of Python; real templates take tens per message)."""

# Any number written in a format string: a width or precision beyond the bound is refused.
_FORMAT_NUMBER = re.compile(r"\d+")
# An exponent beyond this many result bits is refused (a huge int costs memory and time).
_MAX_POWER_BITS = 65_536


def _refuse(what: str) -> jinja2.exceptions.SecurityError:
    return jinja2.exceptions.SecurityError(f"chat template over its bound: {what}")


def _check_number(value: object) -> None:
    """Refuse an int argument (a width, a count) beyond :data:`MAX_RENDERED_CHARS`."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_RENDERED_CHARS:
        raise _refuse(f"argument {value}")


def _check_format(spec: str, star: bool) -> None:
    """Refuse a format string with a width or precision beyond the bound (or, for ``%``, one
    taken from the arguments: ``*``)."""
    if star and "*" in spec:
        raise _refuse("'*' width in a % format")
    for number in _FORMAT_NUMBER.findall(spec):
        if len(number) > 9 or int(number) > MAX_RENDERED_CHARS:
            raise _refuse(f"width {number} in a format string")


def _size(value: object) -> int | None:
    """What ``value`` weighs against :data:`MAX_RENDERED_CHARS`: a string its length, a list or
    tuple 8 per item (an item costs a pointer: 8 bytes, as much as 8 ASCII characters); None
    for anything else."""
    if isinstance(value, str):
        return len(value)
    return 8 * len(value) if isinstance(value, (list, tuple)) else None


def _checked(result: Any) -> Any:
    """``result`` unless it is a string or list beyond the bound (built by a filter or method
    that cannot be checked before: it is refused before anything builds on it)."""
    size = _size(result)
    if size is not None and size > MAX_RENDERED_CHARS:
        raise _refuse(f"a result of {size} items")
    return result


def _check_join(items: Any, separator: str) -> None:
    """Refuse joining ``items`` (strings) when the result would exceed the bound."""
    if isinstance(items, (list, tuple)):
        total = len(separator) * max(len(items) - 1, 0) + sum(
            len(item) if isinstance(item, str) else 0 for item in items)
        if total > MAX_RENDERED_CHARS:
            raise _refuse(f"a join of {total} characters")


def _check_replace(text: Any, old: Any, new: Any) -> None:
    """Refuse ``text.replace(old, new)`` when the result would exceed the bound."""
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        count = text.count(old) if old else len(text) + 1
        if len(text) + count * (len(new) - len(old)) > MAX_RENDERED_CHARS:
            raise _refuse("a replace beyond the bound")


class _BoundedCodeGenerator(jinja2.compiler.CodeGenerator):
    """Jinja's code generator with ``~`` going through the environment's bounded concat."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: jinja2.compiler.Frame) -> None:
        """``a ~ b``: ``environment.concat_bounded((a, b))``."""
        self.write("environment.concat_bounded((")
        for argument in node.nodes:
            self.visit(argument, frame)
            self.write(", ")
        self.write("))")


def _bounded_filter(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (a filter) refusing int arguments beyond the bound (``center``, ``indent``,
    ``batch``, ``truncate``... take widths and counts); the filtered value itself is not
    checked, and ``format``'s value is checked as a % format."""
    skip = 2 if getattr(function, "jinja_pass_arg", None) is not None else 1

    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        for value in (*args[skip:], *kwargs.values()):
            _check_number(value)
        value = args[skip - 1] if len(args) >= skip else None
        if function is _FORMAT_FILTER and isinstance(value, str):
            _check_format(value, star=True)
        elif function is _JOIN_FILTER:
            _check_join(value, str(args[skip] if len(args) > skip else kwargs.get("d", "")))
        elif function is _REPLACE_FILTER and len(args) >= skip + 2:
            _check_replace(value, args[skip], args[skip + 1])
        return _checked(function(*args, **kwargs))

    return bounded


_FORMAT_FILTER = jinja2.filters.FILTERS["format"]
_JOIN_FILTER = jinja2.filters.FILTERS["join"]
_REPLACE_FILTER = jinja2.filters.FILTERS["replace"]


class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with the bounds of this module (see its docstring). One render
    at a time: :meth:`start` gives the next render the whole step budget."""

    intercepted_binops = frozenset({"+", "*", "%", "**"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.steps_left = MAX_RENDER_STEPS
        self.filters = {name: _bounded_filter(function) for name, function in self.filters.items()}
        self.globals["range"] = self._range

    def start(self) -> None:
        """A render begins: the whole budget again."""
        self.steps_left = MAX_RENDER_STEPS

    def step(self, count: int = 1) -> None:
        """Spend ``count`` steps; refuse the render once the budget is spent."""
        self.steps_left -= count
        if self.steps_left < 0:
            raise _refuse(f"more than {MAX_RENDER_STEPS} steps")

    def _range(self, *args: int) -> range:
        numbers = jinja2.sandbox.safe_range(*args)
        self.step(len(numbers) + 1)
        return numbers

    def getattr(self, obj: Any, attribute: str) -> Any:
        """Sandboxed ``obj.attribute``, one step; ``str.format`` with a bounded format."""
        self.steps_left -= 1  # inline: the hooks run several times per message
        if self.steps_left < 0:
            self.step(0)
        if isinstance(obj, str) and attribute in ("format", "format_map"):
            _check_format(obj, star=False)
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        """Sandboxed ``obj[argument]``, one step."""
        self.steps_left -= 1
        if self.steps_left < 0:
            self.step(0)
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any,  # Jinja's signature
             **kwargs: Any) -> Any:
        """Sandboxed call, one step; int arguments (widths, counts) within the bound, and
        ``str.join`` / ``str.replace`` checked for the length they would build."""
        __self.step()
        for value in (*args, *kwargs.values()):
            _check_number(value)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str) and args:
            name = getattr(__obj, "__name__", "")
            if name == "join":
                _check_join(args[0], owner)
            elif name == "replace" and len(args) >= 2:
                _check_replace(owner, args[0], args[1])
        return _checked(super().call(__context, __obj, *args, **kwargs))

    def concat_bounded(self, values: tuple[Any, ...]) -> str:
        """``a ~ b ~ ...`` (Jinja's ``str_join``), one step, refused beyond the bound."""
        self.step()
        parts = [str(value) for value in values]
        if sum(map(len, parts)) > MAX_RENDERED_CHARS:
            raise _refuse("a concatenation beyond the bound")
        return "".join(parts)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        """``+``, ``*``, ``%`` and ``**``, one step, refused when the result would exceed the
        bound."""
        self.steps_left -= 1
        if self.steps_left < 0:
            self.step(0)
        if operator == "+":
            # Templates add strings a few times per message: the common case kept short (the
            # sandbox's own call_binop is this same operator.add).
            if (type(left) is str and type(right) is str
                    and len(left) + len(right) <= MAX_RENDERED_CHARS):
                return left + right
            left_size, right_size = _size(left), _size(right)
            if (left_size is not None and right_size is not None
                    and left_size + right_size > MAX_RENDERED_CHARS):
                raise _refuse(f"a sum of {left_size + right_size} items")
        elif operator == "*":
            for sequence, count in ((left, right), (right, left)):
                size = _size(sequence)
                if (size is not None and isinstance(count, int)
                        and size * count > MAX_RENDERED_CHARS):
                    raise _refuse(f"a repeat to {size * count} items")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, star=True)
        elif (operator == "**" and isinstance(left, int) and isinstance(right, int)
              and abs(left) > 1 and right * max(abs(left).bit_length() - 1, 1) > _MAX_POWER_BITS):
            raise _refuse(f"{left} ** {right}")
        return super().call_binop(context, operator, left, right)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' marker of the assistant's
    tokens, for training masks): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return str(caller())


class ChatTemplateError(LigError, ValueError):
    """A template that cannot be read or compiled (the message says which and why)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' filter: Jinja's own escapes HTML and forces ASCII, which templates rely on not.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _token_text(value: object) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class ChatTemplate:
    """One compiled chat template and the special-token variables it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, Any]) -> None:
        environment = _BoundedSandbox(
            trim_blocks=True, lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        environment.filters["tojson"] = _bounded_filter(_tojson)
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        try:
            self._template = environment.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as error:
            raise ChatTemplateError(f"chat template does not compile: {error}") from None
        self._environment = environment
        self.source = source
        # transformers passes tools and documents even when there are none: templates test
        # them with "is not none", which an undefined variable passes.
        self._variables: dict[str, Any] = {"tools": None, "documents": None, **special_tokens}

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt text of ``messages`` (``role``/``content`` dicts), ending with the opening
        of the assistant's turn; raises ``jinja2.TemplateError`` when the template refuses them
        (e.g. roles out of order) or a bound of this module's docstring is passed."""
        self._environment.start()
        parts: list[str] = []
        length = 0
        for part in self._template.generate(messages=messages, add_generation_prompt=True,
                                            **self._variables):
            length += len(part)
            if length > MAX_RENDERED_CHARS:
                raise _refuse(f"more than {MAX_RENDERED_CHARS} characters of output")
            parts.append(part)
        return "".join(parts)


def load_chat_template(directory: Path, config: Mapping[str, Any]) -> ChatTemplate | None:
    """The chat template of the tokenizer in ``directory`` whose ``tokenizer_config.json`` is
    ``config`` (empty when absent); None when it has none."""
    source: str | None = None
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            source = jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ChatTemplateError(f"{jinja_file}: cannot read: {error}") from None
    else:
        field = config.get("chat_template")
        if isinstance(field, str):
            source = field
        elif isinstance(field, list):
            named = {entry.get("name"): entry.get("template") for entry in field
                     if isinstance(entry, Mapping)}
            default = named.get("default")
            source = default if isinstance(default, str) else None
            if source is None:
                raise ChatTemplateError("tokenizer_config.json: chat_template lists no "
                                        "'default' template")
        elif field is not None:
            raise ChatTemplateError("tokenizer_config.json: chat_template is neither a string "
                                    "nor a list of named templates")
    if source is None:
        return None
    tokens: dict[str, Any] = {name: text for name in _SPECIAL_TOKEN_FIELDS
                              if (text := _token_text(config.get(name))) is not None}
    additional = config.get("additional_special_tokens")
    if isinstance(additional, list):
        tokens["additional_special_tokens"] = [
            text for item in additional if (text := _token_text(item)) is not None]
    return ChatTemplate(source, tokens)
