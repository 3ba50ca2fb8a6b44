"""The text of the benchmark's prompts and the OpenAI request bodies the pickers read.

The engines compute on ``SyntheticPrompt`` segments (``(seed, tokens)`` runs); the picker sees
text. Each segment is rendered as ``tokens`` words of the simulator's vocabulary (one token each
for its tokenizer), taken from one seeded corpus at an offset derived from the segment's seed: the
same segment always reads the same (a shared system prompt, a conversation's earlier turns), and
different segments read differently from their first word on. So whatever the picker derives from
the text (a token estimate, prefix block hashes) matches what the engine caches.

A chat request is a message list, one message per segment (``roles``); a completion request is
one ``prompt`` string of the segments' texts joined by a space.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence

import msgspec

from simulator.engine import SyntheticPrompt
from simulator.tokenizer import WORDS

_CORPUS_WORDS = 1 << 20
_STRIDE = 2_654_435_761  # Knuth's multiplicative hash: neighbouring seeds land far apart


class _Corpus:
    """One long seeded word stream, as a string with each word's start offset."""

    def __init__(self) -> None:
        words = random.Random("bench-text").choices(WORDS, k=_CORPUS_WORDS)
        self.text = " ".join(words) + " "
        starts = [0] * (_CORPUS_WORDS + 1)
        position = 0
        for index, word in enumerate(words):
            starts[index] = position
            position += len(word) + 1
        starts[_CORPUS_WORDS] = position
        self.starts = starts

    def words(self, first: int, count: int) -> str:
        """``count`` words from word ``first`` on, wrapping around the end."""
        parts = []
        while count > 0:
            take = min(count, _CORPUS_WORDS - first)
            parts.append(self.text[self.starts[first]:self.starts[first + take]])
            count -= take
            first = 0
        return "".join(parts)[:-1]


@functools.cache
def _corpus() -> _Corpus:
    return _Corpus()


@functools.lru_cache(maxsize=4096)
def segment_text(seed: int, tokens: int) -> str:
    """The text of a segment: ``tokens`` words, the same for the same ``(seed, tokens)``."""
    return _corpus().words((seed * _STRIDE) % _CORPUS_WORDS, tokens)


class _Message(msgspec.Struct):
    role: str
    content: str


class _ChatBody(msgspec.Struct):
    model: str
    messages: list[_Message]
    max_tokens: int


class _CompletionBody(msgspec.Struct):
    model: str
    prompt: str
    max_tokens: int


_encode = msgspec.json.Encoder().encode


def request_body(model: str, prompt: SyntheticPrompt, roles: Sequence[str] | None,
                 max_tokens: int) -> bytes:
    """The JSON body of a chat request (``roles``: one per segment) or, without roles, of a
    completion request."""
    texts = [segment_text(seed, tokens) for seed, tokens in prompt.segments]
    if roles is None:
        return _encode(_CompletionBody(model, " ".join(texts), max_tokens))
    messages = [_Message(role, text) for role, text in zip(roles, texts, strict=True)]
    return _encode(_ChatBody(model, messages, max_tokens))
