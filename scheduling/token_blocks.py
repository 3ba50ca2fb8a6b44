"""Keys of token-id blocks: what the precise prefix index (issue 16) files a pod's cached blocks
under, and what a tokenized prompt is looked up by.

vLLM's own block hashes are salted per engine and cannot be recomputed outside it, so both sides
hash the token ids themselves: block *i*'s key is xxHash3-64 of its token ids (4-byte
little-endian each) seeded with block *i-1*'s key; the first block is seeded with
:func:`root_key` of the cache it lives in (the base model's, or a LoRA adapter's: each has its
own cache). Equal keys mean equal token prefixes in the same cache, up to 64-bit collisions.
Only full blocks count, as in the engine's prefix cache.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Protocol

import xxhash

_xxh3 = xxhash.xxh3_64_intdigest


def root_key(lora_name: str | None) -> int:
    """The seed of a chain's first block: the base model's cache ("" / None) or an adapter's."""
    return _xxh3((lora_name or "").encode("utf-8", "surrogatepass"))


def block_keys(token_ids: Sequence[int], block_size: int, parent: int,
               max_blocks: int | None = None) -> list[int]:
    """The chained keys of the full blocks of ``token_ids`` (at most ``max_blocks``), the first
    seeded with ``parent`` (:func:`root_key`, or the key of the block before them)."""
    full = len(token_ids) // block_size
    if max_blocks is not None:
        full = min(full, max_blocks)
    if full <= 0:
        return []
    data = array.array("I", token_ids[:full * block_size]).tobytes()
    step = block_size * 4
    return [parent := _xxh3(data[start:start + step], parent)
            for start in range(0, full * step, step)]


class PromptTokenizer(Protocol):
    """A pool's tokenizer as the router uses it: the token ids the engine will see for a
    request's prompt (the chat template applied), or None when it cannot say."""

    def prompt_token_ids(self, prompt: object, messages: object) -> Sequence[int] | None:
        """Token ids of a completion ``prompt`` or of chat ``messages`` (the other is None)."""
        ...
