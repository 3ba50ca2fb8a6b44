"""The text of the benchmark's prompts and the OpenAI request bodies the pickers read.

The engines compute on ``SyntheticPrompt`` segments (``(seed, tokens)`` runs); the picker sees
text. Each segment is rendered as ``tokens`` words of the simulator's vocabulary (one token each
for its tokenizer), taken from one seeded corpus at an offset derived from the segment's seed: the
same segment always reads the same (a shared system prompt, a conversation's earlier turns), and
different segments read differently from their first word on. So whatever the picker derives from
the text (a token estimate, prefix block hashes) matches what the engine caches.

A chat request is a message list, one message per segment (``roles``); a completion request is
one ``prompt`` string of the segments' texts joined by a space, or (a workload with
``token_ids``) the prompt as token ids: each segment's words as the simulator's tokenizer encodes
them (:func:`segment_ids`), which the engine computes on too, so that its KV-cache events carry
the very ids the picker reads (the precise prefix index needs no tokenizer for them).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence

import msgspec

from simulator.engine import SyntheticPrompt
from simulator.tokenizer import WORD_IDS, WORDS

_CORPUS_WORDS = 1 << 20
_STRIDE = 2_654_435_761  # Knuth's multiplicative hash: neighbouring seeds land far apart


class _Corpus:
    """One long seeded word stream, as a string with each word's start offset."""

    def __init__(self) -> None:
        picks = random.Random("bench-text").choices(range(len(WORDS)), k=_CORPUS_WORDS)
        words = [WORDS[pick] for pick in picks]
        self.ids = tuple(WORD_IDS[pick] for pick in picks)
        """Each word's token id (every word of the vocabulary is one token)."""
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

    def word_ids(self, first: int, count: int) -> tuple[int, ...]:
        """The token ids of :meth:`words`."""
        ids = self.ids
        parts = []
        while count > 0:
            take = min(count, _CORPUS_WORDS - first)
            parts.append(ids[first:first + take])
            count -= take
            first = 0
        return parts[0] if len(parts) == 1 else sum(parts, ())


@functools.cache
def _corpus() -> _Corpus:
    return _Corpus()


@functools.lru_cache(maxsize=4096)
def segment_text(seed: int, tokens: int) -> str:
    """The text of a segment: ``tokens`` words, the same for the same ``(seed, tokens)``."""
    return _corpus().words((seed * _STRIDE) % _CORPUS_WORDS, tokens)


@functools.lru_cache(maxsize=4096)
def segment_ids(seed: int, tokens: int) -> tuple[int, ...]:
    """The token ids of :func:`segment_text` (``tokens`` ids)."""
    return _corpus().word_ids((seed * _STRIDE) % _CORPUS_WORDS, tokens)


def prompt_ids(prompt: SyntheticPrompt) -> tuple[int, ...]:
    """The token ids of a prompt: its segments' ids, one after the other."""
    segments = prompt.segments
    if len(segments) == 1:
        return segment_ids(*segments[0])
    return tuple(token for seed, tokens in segments for token in segment_ids(seed, tokens))


class _Message(msgspec.Struct):
    role: str
    content: str


class _ChatBody(msgspec.Struct):
    model: str
    messages: list[_Message]
    max_tokens: int


class _CompletionBody(msgspec.Struct):
    model: str
    prompt: str | tuple[int, ...]
    max_tokens: int


_encode = msgspec.json.Encoder().encode


def request_body(model: str, prompt: SyntheticPrompt | tuple[int, ...],
                 roles: Sequence[str] | None, max_tokens: int) -> bytes:
    """The JSON body of a chat request (``roles``: one per segment) or, without roles, of a
    completion request; a prompt of token ids is a completion request's ``prompt``."""
    if isinstance(prompt, tuple):
        if roles is not None:
            raise ValueError("a prompt of token ids is sent as a completion request, not chat")
        return _encode(_CompletionBody(model, prompt, max_tokens))
    texts = [segment_text(seed, tokens) for seed, tokens in prompt.segments]
    if roles is None:
        return _encode(_CompletionBody(model, " ".join(texts), max_tokens))
    messages = [_Message(role, text) for role, text in zip(roles, texts, strict=True)]
    return _encode(_ChatBody(model, messages, max_tokens))
