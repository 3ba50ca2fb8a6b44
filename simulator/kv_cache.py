"""A paged KV cache with prefix caching, as vLLM V1's block pool keeps it.

The cache has ``num_blocks`` blocks of ``block_size`` tokens. Each block has a reference count
(how many running requests use it) and, once full, a content hash. Blocks nobody references sit
in a free queue in least-recently-freed order: allocation takes blocks from the front, and a
block taken that still holds cached content loses it then (LRU eviction). A request that starts
with content already cached takes references on those blocks instead of computing them again,
even when they sit in the free queue. ``usage`` counts the referenced blocks, which is what vLLM
reports as ``vllm:kv_cache_usage_perc``.

Hashes are made by the engine (it knows the tokens); this module only maps them to blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class KVCache:
    """Block allocation, reference counts and the hash → block map of one engine."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_count = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._block_of: dict[int, int] = {}
        # Front = least recently freed. OrderedDict pops its front in O(1); a dict would not.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

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
        ref_count = self._ref_count
        return sum(1 for block in blocks if ref_count[block] == 0)

    def take(self, blocks: Sequence[int]) -> None:
        """Reference cached ``blocks`` for one more request."""
        ref_count = self._ref_count
        free = self._free
        for block in blocks:
            if ref_count[block] == 0:
                del free[block]
            ref_count[block] += 1

    def allocate(self, count: int) -> list[int] | None:
        """``count`` new blocks for one request, or None (and no change) if too few are free."""
        free = self._free
        if count > len(free):
            return None
        ref_count = self._ref_count
        hash_of = self._hash_of
        taken: list[int] = []
        for _ in range(count):
            block, _ = free.popitem(last=False)
            old_hash = hash_of[block]
            if old_hash is not None:
                hash_of[block] = None
                del self._block_of[old_hash]
            ref_count[block] = 1
            taken.append(block)
        return taken

    def cache(self, block: int, block_hash: int) -> None:
        """Record that full ``block`` holds the content identified by ``block_hash``."""
        if not self.enable_prefix_caching or block_hash in self._block_of:
            # The same content computed twice at once: the first copy stays the cached one.
            return
        if self._hash_of[block] is None:
            self._hash_of[block] = block_hash
            self._block_of[block_hash] = block

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one request's references; blocks freed last-to-first so tails are evicted first."""
        ref_count = self._ref_count
        free = self._free
        for block in reversed(blocks):
            ref_count[block] -= 1
            if ref_count[block] == 0:
                free[block] = None
