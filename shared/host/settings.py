"""Typed service settings: each field declared once, read from a flag, else its environment
variable, else its default.

A service's settings are a ``msgspec.Struct``; each field is annotated with :func:`option`::

    class PickerSettings(msgspec.Struct, frozen=True):
        grpc_port: Annotated[int, option("ext_proc gRPC port", ge=0)] = ports.PICKER_GRPC

That one line gives ``--grpc-port`` (the field name with ``-``), the variable ``LIG_GRPC_PORT``
(the rule: ``LIG_`` + the flag's name in upper case, ``-`` as ``_``), the default and the help,
which ends with ``(default: 9002; env LIG_GRPC_PORT)``. A field whose type is itself such a
Struct (the NATS settings) adds its own flags as a group. :func:`add_flags` declares the flags on
an ``argparse`` parser; :func:`from_args` builds the Struct: flags win over the environment,
the environment over defaults, and an unusable value raises :class:`ConfigError` naming the flag
and the variable. Flag and variable go through the same conversion (msgspec, with the
constraints of the annotation), so they accept the same text.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

import msgspec

from shared.errors import ConfigError

ENV_PREFIX = "LIG_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class Option(msgspec.Struct, frozen=True):
    """How one settings field appears on the command line and in the environment."""

    help: str
    flag: str | None = None  # default: the field name, "_" written "-"
    metavar: str | None = None
    positional: bool = False  # a list of positional arguments (``lig registry PATH...``)
    separator: str = ","  # between the items of a list in its environment variable
    aliases: tuple[str, ...] = ()  # older variable names still read (after the canonical one)
    parse: Callable[[str], Any] | None = None  # text -> value, before msgspec's check
    show_default: bool = True
    default_text: str | None = None  # how help shows a default computed at start (a host name)


def option(help: str, *, flag: str | None = None, metavar: str | None = None,
           positional: bool = False, separator: str = ",", aliases: tuple[str, ...] = (),
           parse: Callable[[str], Any] | None = None, show_default: bool = True,
           default_text: str | None = None, **constraints: Any) -> msgspec.Meta:
    """The annotation of a settings field: its help and, as keywords, msgspec constraints
    (``ge=0``, ``gt=0``, ``min_length=1``...) checked on flag and environment values alike.
    ``default_text`` is what help shows as the default when it is computed at start (it would
    differ from host to host, and so would the help's wrapping)."""
    extra = Option(help, flag, metavar, positional, separator, aliases, parse, show_default,
                   default_text)
    return msgspec.Meta(extra={"option": extra}, **constraints)


def env_name(flag: str) -> str:
    """The environment variable of a flag: ``--grpc-port`` -> ``LIG_GRPC_PORT``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


class _Field(msgspec.Struct, frozen=True):
    """One settings field, resolved from the Struct's annotations."""

    name: str
    dest: str  # the argparse destination (unique across nested Structs)
    kind: Any  # what a given value is converted to: the type with its constraints, not None
    bare: Any  # the type alone
    option: Option
    default: Any
    flag: str
    env: str

    @property
    def is_list(self) -> bool:
        return typing.get_origin(self.bare) in (list, tuple)

    @property
    def is_bool(self) -> bool:
        return self.bare is bool


def _unwrap(kind: Any) -> tuple[Any, Any, Option | None]:
    """The type under ``Annotated`` and ``| None``; the same with the annotation's constraints
    (what a given value is converted to: never None); the field's :class:`Option`."""
    kind = _without_none(kind)
    metas: list[Any] = []
    if typing.get_origin(kind) is Annotated:
        kind, *metas = typing.get_args(kind)
        kind = _without_none(kind)
    found = next((meta.extra["option"] for meta in metas if isinstance(meta, msgspec.Meta)
                  and meta.extra and "option" in meta.extra), None)
    checked = Annotated[(kind, *metas)] if metas else kind
    return kind, checked, found


def _without_none(kind: Any) -> Any:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        if len(members) == 1:
            return members[0]
    return kind


def _is_settings(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, msgspec.Struct)


def _fields(cls: type[msgspec.Struct], prefix: str = "") -> list[_Field | tuple[str, type]]:
    """The fields of ``cls`` in order; a nested settings Struct appears as (name, its class)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    info = msgspec.structs.fields(cls)
    result: list[_Field | tuple[str, type]] = []
    for field in info:
        bare, checked, found = _unwrap(hints[field.name])
        if found is None:
            if _is_settings(bare):
                result.append((field.name, bare))
                continue
            raise TypeError(f"{cls.__name__}.{field.name} has no option(...) annotation")
        if field.default is not msgspec.NODEFAULT:
            default = field.default
        elif field.default_factory is not msgspec.NODEFAULT:
            default = field.default_factory()
        else:
            raise TypeError(f"{cls.__name__}.{field.name} needs a default")
        flag = found.flag or "--" + field.name.replace("_", "-")
        result.append(_Field(field.name, prefix + field.name, checked, bare, found, default,
                             flag, env_name(flag)))
    return result


def _help(field: _Field) -> str:
    shown = field.option.show_default and field.default not in (None, [], (), "")
    default = (field.option.default_text if field.option.default_text is not None else
               ", ".join(field.default) if field.is_list else
               ("on" if field.default else "off") if field.is_bool else field.default)
    details = [f"default: {default}"] if shown else []
    details.append("env " + " or ".join((field.env, *field.option.aliases)))
    # argparse formats help with "%": a literal percent sign must be doubled.
    return f"{field.option.help} ({'; '.join(details)})".replace("%", "%%")


def add_flags(parser: argparse.ArgumentParser, cls: type[msgspec.Struct],
              prefix: str = "") -> None:
    """Declare the flags of every field of ``cls`` (and of its nested settings) on ``parser``."""
    group: Any = parser
    if prefix:
        group = parser.add_argument_group(prefix.rstrip("_").upper().replace("_", " "))
    for field in _fields(cls, prefix):
        if isinstance(field, tuple):
            add_flags(parser, field[1], prefix + field[0] + "__")
            continue
        # SUPPRESS: a flag not given leaves no attribute, so the environment can apply.
        common: dict[str, Any] = {"default": argparse.SUPPRESS, "help": _help(field)}
        metavar = field.option.metavar or field.flag.lstrip("-").upper().replace("-", "_")
        # With a parse function (say str.upper) argparse would check the text before it.
        choices = None if field.option.parse is not None else _choices(field.bare)
        if choices:
            common["choices"] = choices
        if field.option.positional:
            group.add_argument(field.dest, nargs="*", metavar=metavar, **common)
        elif field.is_bool:
            group.add_argument(field.flag, dest=field.dest,
                               action=argparse.BooleanOptionalAction, **common)
        else:
            group.add_argument(field.flag, dest=field.dest,
                               metavar=None if choices else metavar,
                               action="append" if field.is_list else "store", **common)


def _choices(kind: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(kind) is Literal:
        return typing.get_args(kind)
    return None


def from_args(cls: type[msgspec.Struct], args: argparse.Namespace,
              environ: Mapping[str, str] | None = None, prefix: str = "") -> Any:
    """Build ``cls`` from parsed flags, then ``environ`` (default: ``os.environ``), then
    defaults. Raises :class:`ConfigError` naming the flag and variable of a bad value; errors
    of the Struct's own checks (``__post_init__`` raising ``ValueError``) come as ConfigError
    too."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for field in _fields(cls, prefix):
        if isinstance(field, tuple):
            values[field[0]] = from_args(field[1], args, environ, prefix + field[0] + "__")
            continue
        given = getattr(args, field.dest, None)
        if given is not None:
            values[field.name] = _convert(field, given, f"{field.flag} (env {field.env})")
            continue
        for variable in (field.env, *field.option.aliases):
            text = environ.get(variable)
            if text:
                values[field.name] = _convert(field, _from_env(field, text),
                                              f"{variable} (flag {field.flag})")
                break
    try:
        return cls(**values)
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc)) from None


def _from_env(field: _Field, text: str) -> Any:
    if field.is_list:
        return [item for item in text.split(field.option.separator) if item.strip()]
    if field.is_bool:
        lowered = text.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise ConfigError(f"{field.env} (flag {field.flag}): expected one of "
                          f"{', '.join(_TRUE + _FALSE)}, not {text!r}")
    return text


def _convert(field: _Field, raw: Any, source: str) -> Any:
    """``raw`` (text or a list of texts) as the field's type, its constraints checked."""
    parse = field.option.parse
    try:
        if parse is not None:
            raw = [parse(item) for item in raw] if field.is_list else parse(raw)
        if field.is_list:
            raw = [item.strip() if isinstance(item, str) else item for item in raw]
        return msgspec.convert(raw, field.kind, strict=False)
    except (msgspec.ValidationError, ValueError) as exc:
        detail = str(exc).split(" - at ")[0]  # msgspec's path is the field itself
        raise ConfigError(f"{source}: {detail}: {raw!r}") from None
