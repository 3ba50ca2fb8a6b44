"""Generated text of ``lig sim``'s simulated model, in the ``builtin:lig-sim`` tokenizer.

The tokenizer and chat template themselves are :mod:`scheduling.lig_sim_tokenizer` (the pickers
tokenize with them too). The simulated model emits words from ``WORDS`` (each a single piece),
chosen by a seeded RNG, as " word" tokens. Because each word tokenizes back to exactly its own
token id, a conversation that sends the assistant's answer back in its next turn (through
``render_chat``) reproduces the token ids the engine generated, so multi-turn chats hit the
prefix cache as they do on vLLM.
"""

from __future__ import annotations

import random

from scheduling.lig_sim_tokenizer import token_id

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


WORD_IDS: tuple[int, ...] = tuple(token_id(word) for word in WORDS)


def generate_words(count: int, seed: int) -> list[int]:
    """Indices into ``WORDS`` of ``count`` generated tokens, reproducible from ``seed``."""
    rng = random.Random(seed)
    size = len(WORDS)
    return [rng.randrange(size) for _ in range(count)]


def token_text(word_index: int, first: bool) -> str:
    """The text of one generated token: the word, after a space unless it opens the answer."""
    word = WORDS[word_index]
    return word if first else " " + word
