"""A paged KV cache with prefix caching, as vLLM V1's block pool keeps it.

The cache has ``num_blocks`` blocks of ``block_size`` tokens. Each block has a reference count
(how many running requests use it) and, once full, a content hash. Blocks nobody references sit
in a free queue in least-recently-freed order: allocation takes blocks from the front, and a
block taken that still holds cached content loses it then (LRU eviction). A request that starts
with content already cached takes references on those blocks instead of computing them again,
even when they sit in the free queue. ``usage`` counts the referenced blocks, which is what vLLM
reports as ``vllm:kv_cache_usage_perc``.

Hashes are made by ``block_hashes`` (it knows the tokens); this module only maps them to
blocks. The engine may leave a block's content out of the map while no other request can ask for
it (see ``prefix_sharing``); it then notes the block's position in the free queue when it frees
it, and can tell later whether the block still holds that content (``still_free``).

KV-cache events (vLLM's ``--kv-events-config``): when ``events`` is a list, blocks losing their
content append a ``BlockRemoved`` to it (``prefix_sharing`` appends the ``BlockStored``); when it
is None (the default) nothing is recorded and allocation costs what it did.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from shared.kv_events import BlockRemoved, Event


class KVCache:
    """Block allocation, reference counts and the hash → block map of one engine."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Free blocks have no reference; any other block has one, plus those counted in
        # _shared (blocks several running requests share). Most blocks have a single owner, so
        # allocating and freeing them are bulk operations on the free queue.
        self._free: set[int] = set(range(num_blocks))
        self._shared: dict[int, int] = {}
        # The free queue, front = least recently freed. A cached block taken out of it by
        # ``take`` leaves its entry behind, counted in _left_behind and skipped when reached.
        self._queue: deque[int] = deque(range(num_blocks))
        self._left_behind: dict[int, int] = {}
        self._hash_of: list[int | None] = [None] * num_blocks
        self._block_of: dict[int, int] = {}
        self.queued = num_blocks
        """Free queue positions handed out: the next block freed takes position ``queued``."""
        self.dequeued = 0
        """Free queue positions consumed: the block at position ``p`` left the queue (or was
        taken from it) once ``p < dequeued``, see ``still_free``."""
        self.events: list[Event] | None = None
        """KV-cache events since the publisher last took them; None: not recorded."""

    @property
    def num_free(self) -> int:
        """Blocks no request references (some may still hold reusable cached content)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests, 0..1."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached(self) -> int:
        """Blocks whose content can be reused by a later request."""
        return len(self._block_of)

    def cached_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached run of ``hashes`` from the start."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        block_of = self._block_of
        for block_hash in hashes:
            block = block_of.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def count_unreferenced(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` sit in the free queue (taking them shrinks it)."""
        free = self._free
        return sum(1 for block in blocks if block in free)

    def take(self, blocks: Sequence[int]) -> None:
        """Reference cached ``blocks`` for one more request."""
        free = self._free
        shared = self._shared
        left_behind = self._left_behind
        for block in blocks:
            if block in free:
                free.remove(block)
                left_behind[block] = left_behind.get(block, 0) + 1
            else:
                shared[block] = shared.get(block, 0) + 1

    def allocate(self, count: int) -> list[int] | None:
        """``count`` new blocks for one request, or None (and no change) if too few are free."""
        free = self._free
        if count > len(free):
            return None
        if self._left_behind:
            taken = self._pop_skipping_left_behind(count)
        else:
            popleft = self._queue.popleft
            taken = [popleft() for _ in range(count)]
            self.dequeued += count
        free.difference_update(taken)
        block_of = self._block_of
        if block_of:  # some blocks hold cached content: the ones taken lose it
            hash_of = self._hash_of
            removed: list[int] | None = [] if self.events is not None else None
            for block in taken:
                old_hash = hash_of[block]
                if old_hash is not None:
                    hash_of[block] = None
                    del block_of[old_hash]
                    if removed is not None:
                        removed.append(old_hash)
            if removed and self.events is not None:
                self.events.append(BlockRemoved(tuple(removed), "GPU"))
        return taken

    def cache(self, block: int, block_hash: int) -> bool:
        """Record that full ``block`` holds the content identified by ``block_hash``; True if
        it entered the hash map (a new cached block)."""
        if not self.enable_prefix_caching or block_hash in self._block_of:
            # The same content computed twice at once: the first copy stays the cached one.
            return False
        if self._hash_of[block] is None:
            self._hash_of[block] = block_hash
            self._block_of[block_hash] = block
            return True
        return False

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one request's references; blocks freed last-to-first so tails are evicted first.
        The last block of ``blocks``, if freed, takes free queue position ``queued``, the one
        before it the next position, and so on."""
        shared = self._shared
        if not shared or shared.keys().isdisjoint(blocks):
            freed: Sequence[int] = blocks[::-1]
        else:
            freed = []
            for block in reversed(blocks):
                if not _drop_one(shared, block):
                    freed.append(block)
        self._queue.extend(freed)
        self._free.update(freed)
        self.queued += len(freed)

    def still_free(self, position: int) -> bool:
        """True if the block freed at free queue ``position`` has not been allocated or taken
        since (for a block whose content is not cached, which cannot be taken)."""
        return position >= self.dequeued

    def _pop_skipping_left_behind(self, count: int) -> list[int]:
        """The first ``count`` free blocks of the queue, dropping the entries left behind."""
        popleft = self._queue.popleft
        left_behind = self._left_behind
        taken: list[int] = []
        while len(taken) < count:
            block = popleft()
            self.dequeued += 1
            if not _drop_one(left_behind, block):
                taken.append(block)
        return taken


def _drop_one(counts: dict[int, int], block: int) -> bool:
    """Take one of ``block``'s counted references away; False when it had none."""
    count = counts.get(block)
    if count is None:
        return False
    if count == 1:
        del counts[block]
    else:
        counts[block] = count - 1
    return True
