"""What the picker reads of a prompt: the OpenAI body fields, a token estimate, the bytes to hash.

Token estimate (the rule, documented in docs/scheduling.md): **one token per 4 characters**
(Unicode code points) of prompt text, rounded up, the ratio OpenAI documents for English text
with BPE tokenizers; a prompt given as token ids counts one token per id. For chat the whole
message list counts: every message's text (its string content, or the ``text`` of each of its
content parts) plus :data:`MESSAGE_OVERHEAD_TOKENS` for the role and the chat template's
delimiters. Non-text parts (images, audio) are not counted. A batch (a list of prompts) counts
every prompt. The estimate only has to rank pods' unreported load, not to bill anyone: no
tokenizer runs on the request path.

Bytes to hash (the input of ``scheduling/prefix_hash.py``): the completion prompt's UTF-8 text
(the first prompt of a batch: prefixes are per prompt), token ids as 4-byte little-endian
integers, and for chat every message in order as ``role NUL text RS`` so that the same words
under another role, or split across messages differently, give other blocks.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence

import msgspec

from scheduling.prefix_hash import BLOCK_BYTES, MAX_BLOCKS

CHARS_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 4
# Only this many bytes are ever hashed; a character is at least one byte, so keeping this many
# characters of text is enough, and a huge prompt costs its length, not an encoding of it all.
HASHED_BYTES = BLOCK_BYTES * MAX_BLOCKS
# The most tokens one hashed block stands for: its bytes at one token per 4 characters (a
# character is at least one byte), or as many 4-byte token ids.
BLOCK_TOKENS = BLOCK_BYTES // CHARS_PER_TOKEN


class ContentPart(msgspec.Struct):
    """One part of a chat message's content; only ``text`` parts are read."""

    type: str = "text"
    text: str | None = None


class Message(msgspec.Struct):
    """One chat message: its role and content (a string, a list of parts, or none)."""

    role: str = ""
    content: str | list[ContentPart] | None = None


# A completion prompt: text, a batch of texts, token ids, or a batch of token-id lists.
CompletionPrompt = str | list[str | int | list[int]]


class PromptDigest(msgspec.Struct, frozen=True):
    """The estimated prompt tokens of a request and the bytes its prefix hashes are taken of."""

    tokens: int = 0
    data: bytes = b""


NO_PROMPT = PromptDigest()


def text_tokens(chars: int) -> int:
    """Tokens estimated for ``chars`` characters of text: ``ceil(chars / CHARS_PER_TOKEN)``."""
    return -(-chars // CHARS_PER_TOKEN)


def completion_prompt(prompt: CompletionPrompt | None) -> PromptDigest:
    """Digest a completions ``prompt`` (text, batch of texts, token ids or batch of id lists)."""
    if prompt is None:
        return NO_PROMPT
    if isinstance(prompt, str):
        return PromptDigest(text_tokens(len(prompt)), _utf8(prompt[:HASHED_BYTES]))
    if not prompt:
        return NO_PROMPT
    first = prompt[0]
    if isinstance(first, int):  # one prompt of token ids
        return PromptDigest(len(prompt), _ids_bytes(prompt))
    tokens = 0
    for item in prompt:
        if isinstance(item, str):
            tokens += text_tokens(len(item))
        elif isinstance(item, list):
            tokens += len(item)
        else:  # a bare id mixed into a batch: one token, as vLLM would reject it anyway
            tokens += 1
    data = _utf8(first[:HASHED_BYTES]) if isinstance(first, str) else _ids_bytes(first)
    return PromptDigest(tokens, data)


def chat_prompt(messages: Sequence[Message] | None) -> PromptDigest:
    """Digest a chat ``messages`` list: every message, in order, with its role."""
    if not messages:
        return NO_PROMPT
    pieces: list[str] = []
    chars = 0
    kept = 0  # characters in pieces: past HASHED_BYTES, messages are only counted
    for message in messages:
        content = message.content
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            text = "\n".join([part.text for part in content if part.text is not None])
        chars += len(text)
        if kept < HASHED_BYTES:
            piece = f"{message.role}\x00{text}\x1e"
            pieces.append(piece)
            kept += len(piece)
    tokens = text_tokens(chars) + MESSAGE_OVERHEAD_TOKENS * len(messages)
    return PromptDigest(tokens, _utf8("".join(pieces)[:HASHED_BYTES]))


def _utf8(text: str) -> bytes:
    """UTF-8, with lone surrogates (valid in JSON escapes) passed through rather than refused."""
    return text.encode("utf-8", "surrogatepass")


def _ids_bytes(ids: Sequence[int | str | list[int]]) -> bytes:
    """Token ids as 4-byte little-endian unsigned integers (as many as get hashed); no bytes
    when one does not fit (or is not an int): such a prompt gets no prefix hashes, which only
    costs affinity."""
    try:
        # A non-int item raises TypeError here, which is the check this function relies on.
        packed = array.array("I", ids[:HASHED_BYTES // 4])  # type: ignore[type-var]
    except (OverflowError, TypeError):
        return b""
    if packed.itemsize != 4:  # pragma: no cover - every CPython platform we run on has 4
        return b""
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()
