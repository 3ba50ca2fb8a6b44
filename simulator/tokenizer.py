"""A deterministic, cheap stand-in for a real tokenizer, a chat template, and generated text.

Tokenizing: the text is cut into pieces by one regular expression: runs of up to 6 letters, runs
of up to 3 digits, and single punctuation or symbol characters; whitespace only separates pieces.
A piece's token id is ``crc32(piece) mod VOCAB_SIZE``. English prose comes out at roughly 1.2
tokens per word, close to real BPE tokenizers, and equal texts always give equal ids, which is all
prefix caching needs.

Generating: the simulated model emits words from ``WORDS`` (each a single piece), chosen by a
seeded RNG, as " word" tokens. Because each word tokenizes back to exactly its own token id, a
conversation that sends the assistant's answer back in its next turn (through ``render_chat``)
reproduces the token ids the engine generated, so multi-turn chats hit the prefix cache as they do
on vLLM.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Sequence

VOCAB_SIZE = 128_256

_PIECE = re.compile(r"\d{1,3}|[^\W\d]{1,6}|[^\w\s]")

# Common English words of at most 6 letters: each is exactly one token of this tokenizer.
WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are",
    "as", "with", "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by",
    "word", "but", "not", "what", "all", "were", "we", "when", "your", "can", "said", "there",
    "use", "an", "each", "which", "she", "do", "how", "their", "if", "will", "up", "other",
    "about", "out", "many", "then", "them", "these", "so", "some", "her", "would", "make", "like",
    "him", "into", "time", "has", "look", "two", "more", "write", "go", "see", "number", "no",
    "way", "could", "people", "my", "than", "first", "water", "been", "call", "who", "oil", "its",
    "now", "find", "long", "down", "day", "did", "get", "come", "made", "may", "part", "over",
    "new", "sound", "take", "only", "little", "work", "know", "place", "year", "live", "me",
    "back", "give", "most", "very", "after", "thing", "our", "just", "name", "good", "man",
    "think", "say", "great", "where", "help", "much", "before", "line", "right", "too", "mean",
    "old", "any", "same", "tell", "boy", "follow", "came", "want", "show", "also", "around",
    "form", "three", "small", "set", "put", "end", "does", "well", "large", "must", "big", "even",
    "such", "turn", "here", "why", "ask", "went", "men", "read", "need", "land", "home", "us",
    "move", "try", "kind", "hand", "again", "change", "off", "play", "spell", "air", "away",
    "animal", "house", "point", "page", "letter", "mother", "answer", "found", "study", "still",
    "learn", "should", "world", "high", "every", "near", "add", "food", "own", "below", "plant",
    "last", "school", "father", "keep", "tree", "never", "start", "city", "earth", "eye", "light",
    "head", "under", "story", "saw", "left", "few", "while", "along", "might", "close", "seem",
    "next", "hard", "open", "begin", "life", "always", "those", "both", "paper", "got", "group",
    "often", "run",
)


def token_id(piece: str) -> int:
    """The id of one piece."""
    return zlib.crc32(piece.encode()) % VOCAB_SIZE


WORD_IDS: tuple[int, ...] = tuple(token_id(word) for word in WORDS)


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


def generate_words(count: int, seed: int) -> list[int]:
    """Indices into ``WORDS`` of ``count`` generated tokens, reproducible from ``seed``."""
    rng = random.Random(seed)
    size = len(WORDS)
    return [rng.randrange(size) for _ in range(count)]


def token_text(word_index: int, first: bool) -> str:
    """The text of one generated token: the word, after a space unless it opens the answer."""
    word = WORDS[word_index]
    return word if first else " " + word
