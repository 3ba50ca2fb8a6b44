"""Which collector scrapes which pod: rendezvous (highest-random-weight) hashing.

Every collector computes the same answer from the same live set, with no coordination. When a
collector joins or leaves, only the pods it gains or loses move (about 1/n of them); the rest
stay where they are, so their scrape cadence is undisturbed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping
from typing import TypeVar

T = TypeVar("T")


def _weight(collector_id: str, pod_key: str) -> int:
    # blake2b rather than hash(): the answer must agree across processes and hosts.
    digest = hashlib.blake2b(f"{collector_id}\0{pod_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def owner(pod_key: str, collectors: Collection[str]) -> str:
    """The collector that scrapes ``pod_key``; ties (practically impossible) go to the larger id."""
    if not collectors:
        raise ValueError("no live collectors")
    return max(collectors, key=lambda collector: (_weight(collector, pod_key), collector))


def owned_by(me: str, items: Mapping[str, T], collectors: Collection[str]) -> dict[str, T]:
    """The entries of ``items`` (by pod key) that ``me`` owns among ``collectors`` (me included)."""
    live = set(collectors) | {me}
    return {key: item for key, item in items.items() if owner(key, live) == me}
