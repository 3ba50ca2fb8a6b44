"""``builtin:lig-sim``: the tokenizer and chat template ``lig sim``'s simulated engines use.

It lives here, not in ``simulator/``, because a picker routing to simulated pods must tokenize
as they do (:class:`scheduling.prompt_tokenizers.SimTokenizer`); the simulator imports it from
here, so the picker never loads simulator code.

Tokenizing: the text is cut into pieces by one regular expression: runs of up to 6 letters, runs
of up to 3 digits, and single punctuation or symbol characters; whitespace only separates pieces.
A piece's token id is ``crc32(piece) mod VOCAB_SIZE``. English prose comes out at roughly 1.2
tokens per word, close to real BPE tokenizers, and equal texts always give equal ids, which is all
prefix caching needs.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence

VOCAB_SIZE = 128_256

_PIECE = re.compile(r"\d{1,3}|[^\W\d]{1,6}|[^\w\s]")


def token_id(piece: str) -> int:
    """The id of one piece."""
    return zlib.crc32(piece.encode()) % VOCAB_SIZE


def encode(text: str) -> tuple[int, ...]:
    """Token ids of ``text``."""
    return tuple(zlib.crc32(piece.encode()) % VOCAB_SIZE for piece in _PIECE.findall(text))


# Opens the assistant's turn at the end of every chat prompt.
ASSISTANT_OPENING = "<|start|>assistant\n"


def render_turn(role: str, content: str) -> str:
    """One message of the chat template. Every turn starts with a symbol and ends with a
    newline, and no piece spans whitespace or a symbol, so a chat's token ids are the
    concatenation of its turns' (what lets a router cache them per message)."""
    return f"<|start|>{role}\n{content}<|end|>\n"


def render_chat(messages: Sequence[tuple[str, str]]) -> str:
    """The prompt for (role, content) messages, ending with the assistant's turn opening."""
    parts = [render_turn(role, content) for role, content in messages]
    parts.append(ASSISTANT_OPENING)
    return "".join(parts)
