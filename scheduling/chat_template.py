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
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

# The tokenizer_config.json fields a template may read as variables.
_SPECIAL_TOKEN_FIELDS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                         "cls_token", "mask_token")


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


class ChatTemplateError(ValueError):
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
        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        try:
            self._template = environment.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as error:
            raise ChatTemplateError(f"chat template does not compile: {error}") from None
        self.source = source
        # transformers passes tools and documents even when there are none: templates test
        # them with "is not none", which an undefined variable passes.
        self._variables: dict[str, Any] = {"tools": None, "documents": None, **special_tokens}

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt text of ``messages`` (``role``/``content`` dicts), ending with the opening
        of the assistant's turn; raises ``jinja2.TemplateError`` when the template refuses them
        (e.g. roles out of order)."""
        return self._template.render(messages=messages, add_generation_prompt=True,
                                     **self._variables)


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
