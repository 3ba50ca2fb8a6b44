"""Refusing a publish that would take every pool, or every endpoint of a pool, out of service.

An emptied input (a truncated file, an empty ConfigMap, a folder whose files were moved away) is
valid YAML describing nothing; publishing it would delete every KV key and every request would get
a 503 until the input is restored. The registry therefore compares what it is about to publish
with what the bucket holds, and refuses (writing nothing) when

- the bucket holds at least one pool and the input holds none, or
- a pool that stays listed endpoints in the bucket and would list none.

Removing some of several pools, or some endpoints of a pool, is ordinary and allowed. An operator
who really means to empty the registry says so with ``--allow-empty``. An empty input over an
empty bucket removes nothing and is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import msgspec

from shared.schemas import DecodeError, EndpointSet, decode
from shared.subjects import unescape_token

POOL_PREFIX = "pool."
ENDPOINTS_PREFIX = "endpoints."
NAMES_SHOWN = 5


class Refusal(msgspec.Struct, frozen=True):
    """Why a publish was refused: ``reason`` is the metric label, ``message`` says it in full."""

    reason: Literal["no_pools", "no_endpoints"]
    message: str


def removal_refusal(desired: Mapping[str, bytes], current: Mapping[str, bytes]) -> Refusal | None:
    """The refusal for replacing the bucket's ``current`` entries with ``desired``, if any."""
    current_pools = sorted(key.removeprefix(POOL_PREFIX) for key in current
                           if key.startswith(POOL_PREFIX))
    if current_pools and not any(key.startswith(POOL_PREFIX) for key in desired):
        return Refusal("no_pools", f"the inputs define no pools; publishing them would delete "
                                   f"every pool ({_names(current_pools)})")
    emptied = []
    for token in current_pools:
        key = ENDPOINTS_PREFIX + token
        if POOL_PREFIX + token in desired and key in current and _count(current[key]) > 0 \
                and _count(desired.get(key, b"")) == 0:
            emptied.append(token)
    if emptied:
        return Refusal("no_endpoints", f"the inputs list no endpoints for pool(s) that have "
                                       f"some now ({_names(emptied)})")
    return None


def _count(value: bytes) -> int:
    """Endpoints in an encoded EndpointSet; 0 for an absent key, -1 when it cannot be read (an
    entry this registry cannot judge is never a reason to refuse)."""
    if not value:
        return 0
    try:
        return len(decode(value, EndpointSet).endpoints)
    except DecodeError:
        return -1


def _names(tokens: list[str]) -> str:
    shown = ", ".join(unescape_token(token) for token in tokens[:NAMES_SHOWN])
    more = len(tokens) - NAMES_SHOWN
    return f"{shown} and {more} more" if more > 0 else shown
