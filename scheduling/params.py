"""Typed parameters for policies and plugins, with errors that name the offending parameter."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from shared.errors import ConfigError


class PolicyConfigError(ConfigError):
    """A policy configuration is unusable: unknown policy, unknown or mistyped parameter."""


P = TypeVar("P", bound=msgspec.Struct)


def parse_params(params: Mapping[str, Any], params_type: type[P], owner: str) -> P:
    """Check ``params`` against the fields of ``params_type`` and build it.

    Each value is converted on its own so that the error names the parameter; an int is accepted
    where a float is expected, nothing else is coerced (``"50"`` is not an int, ``True`` is not 1).
    """
    fields = {field.name: field for field in msgspec.structs.fields(params_type)}
    values: dict[str, Any] = {}
    for key, value in params.items():
        field = fields.get(key)
        if field is None:
            known = ", ".join(fields) or "none"
            raise PolicyConfigError(f"{owner}: unknown parameter {key!r} (known: {known})")
        try:
            values[key] = msgspec.convert(value, field.type)
        except msgspec.ValidationError as exc:
            raise PolicyConfigError(f"{owner}: parameter {key!r}: {exc} (got {value!r})") from None
    return params_type(**values)
