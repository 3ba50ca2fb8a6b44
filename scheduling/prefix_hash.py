"""Chained hashes of a prompt's fixed-size blocks: the keys of the prefix index.

The prompt's bytes (``scheduling/prompt.py``) are cut into blocks of :data:`BLOCK_BYTES`; only
full blocks count (a model server caches whole blocks too). Block *i*'s hash is xxHash3-64 of its
bytes seeded with block *i-1*'s hash (the first seeded with a hash of the target model, since
each model or LoRA adapter has its own cache), so equal hashes mean equal prefixes, up to 64-bit
collisions. The hashes depend on nothing but the bytes: every picker replica, and the benchmark,
computes the same ones (never Python's ``hash()``, which is salted per process).

Why xxHash3 and 512-byte blocks (``bench/bench_prefix.py`` measures it): on a 16,000-character
chat prompt, chaining zlib.crc32 cost about 2.5x and blake2b (8-byte digest) about 10x what
xxh3_64 costs; blocks of 512 bytes (about 128 tokens) halve the hashing and index work of 256-byte
blocks, and 128 tokens is fine-grained enough to tell prompts of thousands of tokens apart.
At most :data:`MAX_BLOCKS` blocks (128 KiB, about 32,000 tokens) are hashed, bounding the cost.
"""

from __future__ import annotations

import xxhash

BLOCK_BYTES = 512
MAX_BLOCKS = 256

_xxh3 = xxhash.xxh3_64_intdigest


def model_seed(target_model: str) -> int:
    """The chain's starting seed for ``target_model``."""
    return _xxh3(target_model.encode("utf-8", "surrogatepass"))


def prefix_hashes(data: bytes, target_model: str, block_bytes: int = BLOCK_BYTES,
                  max_blocks: int = MAX_BLOCKS) -> tuple[int, ...]:
    """The chained hashes of the full blocks of ``data`` (at most ``max_blocks``)."""
    full = min(len(data) // block_bytes, max_blocks)
    if full == 0:
        return ()
    seed = model_seed(target_model)
    # A comprehension: the per-block interpreter overhead is most of the cost at 512 bytes.
    return tuple([seed := _xxh3(data[start:start + block_bytes], seed)
                  for start in range(0, full * block_bytes, block_bytes)])
