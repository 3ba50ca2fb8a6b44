"""Block changes NATS could not take yet, held in order until it is back (pure logic).

While NATS is away (or a publish fails) the bridge keeps applying each pod's batches, so what
it cannot publish would be lost, and subscribers would never know. The outbox holds those
changes, per pod and rank in order, within a bound in messages and bytes over the whole bridge.
Past the bound, the pod-rank holding the most bytes has its held changes replaced by one resync
marker (``AllBlocksCleared``, ``resync``): subscribers are told they lost changes instead of
missing them silently, and its later changes queue behind the marker. The largest goes first so
that quiet pods, whose few held changes are worth the most, keep their exact state longest.
"""

from __future__ import annotations

from collections import deque

import msgspec

from shared.kv_blocks import KVBlockChanges, marker

Key = tuple[str, str, int]
"""(pool, pod, dp_rank): one stream of changes."""


def key_of(changes: KVBlockChanges) -> Key:
    """The stream ``changes`` belong to."""
    return changes.pool, changes.pod, changes.dp_rank


class Held(msgspec.Struct):
    """One pod-rank's held changes, oldest first, and their encoded size."""

    changes: deque[tuple[KVBlockChanges, int]]
    size: int = 0

    def only_marker(self) -> bool:
        """Collapsing it again would free nothing."""
        return len(self.changes) == 1 and self.changes[0][0].resync


class Outbox:
    """Changes not published yet, at most ``max_messages`` and ``max_bytes`` (beyond, pod-ranks
    collapse to a resync marker each; markers alone may exceed the bound, one per pod-rank)."""

    def __init__(self, max_messages: int, max_bytes: int) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self._held: dict[Key, Held] = {}
        self.messages = 0
        self.bytes = 0
        self.collapsed: set[Key] = set()
        """Pod-ranks replaced by a marker since the outbox was last empty (one outage)."""
        self.dropped = 0
        """Changes replaced by markers, ever."""

    def __bool__(self) -> bool:
        return self.messages > 0

    def put(self, changes: KVBlockChanges, size: int, now: float) -> list[Key]:
        """Hold ``changes`` (``size`` bytes encoded) behind its pod-rank's; returns the
        pod-ranks newly replaced by a marker in this outage (to be logged once each). ``now``
        is the markers' time."""
        key = key_of(changes)
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = Held(deque())
        held.changes.append((changes, size))
        held.size += size
        self.messages += 1
        self.bytes += size
        newly: list[Key] = []
        while self.messages > self.max_messages or self.bytes > self.max_bytes:
            largest = max((k for k, h in self._held.items() if not h.only_marker()),
                          key=lambda k: self._held[k].size, default=None)
            if largest is None:
                break  # markers only: nothing left to free
            self._collapse(largest, now)
            if largest not in self.collapsed:
                self.collapsed.add(largest)
                newly.append(largest)
        return newly

    def _collapse(self, key: Key, now: float) -> None:
        held = self._held[key]
        first = held.changes[0][0]
        self.dropped += sum(not c.resync for c, _ in held.changes)
        replacement = marker(first.pool, first.pod, first.address, first.dp_rank, now,
                             resync=True)
        size = len(msgspec.msgpack.encode(replacement))
        self.messages -= len(held.changes) - 1
        self.bytes -= held.size - size
        held.changes = deque([(replacement, size)])
        held.size = size

    def peek(self) -> KVBlockChanges | None:
        """The next change to publish (the oldest pod-rank first), None when empty."""
        for held in self._held.values():
            return held.changes[0][0]
        return None

    def pop(self) -> None:
        """The change :meth:`peek` gave went out: forget it."""
        key = next(iter(self._held))
        held = self._held[key]
        _, size = held.changes.popleft()
        held.size -= size
        self.messages -= 1
        self.bytes -= size
        if not held.changes:
            del self._held[key]
        if not self._held:
            self.collapsed.clear()  # the outage is over: the next one logs again
