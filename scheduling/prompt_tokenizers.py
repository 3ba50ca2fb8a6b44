"""Pools' tokenizers for precise prefix routing: the token ids the engine will see for a request.

Each implements :class:`scheduling.token_blocks.PromptTokenizer`. What they agree on:

- A completion prompt of token ids is used as is (no tokenizer runs; the engine adds nothing to
  token ids); a batch of prompts is routed by its first prompt.
- Completion text is tokenized with the tokenizer's special tokens added (vLLM's default for
  ``/v1/completions``); chat messages are rendered with the chat template and tokenized without
  adding any (vLLM's default for chat: the template writes them).
- None when the request cannot be tokenized as the engine would: chat without a template,
  non-text content parts (images, audio), a template that refuses the messages or passes a
  bound of :mod:`scheduling.chat_template`, more than :data:`MAX_CHAT_MESSAGES` messages for a
  template, text the tokenizer rejects. The router then uses the approximate index for that request.

Two kinds, chosen by :func:`load_prompt_tokenizer`:

- ``builtin:lig-sim``: ``lig sim``'s tokenizer and chat template
  (:mod:`scheduling.lig_sim_tokenizer`).
- a Hugging Face ``tokenizer.json`` (the ``tokenizers`` package) with the chat template of its
  ``tokenizer_config.json`` or ``chat_template.jinja`` (:mod:`scheduling.chat_template`).

Shared prefixes are not tokenized twice. The text is cut where the tokenizer itself cuts it
before any model runs: at its added (special) tokens for Hugging Face tokenizers, which every
chat template writes between messages, and at every message for the simulator's. Each piece's
token ids are kept in a bounded cache (:class:`IdsCache`), keyed by a 128-bit hash of the text,
so a long system prompt or conversation history costs one hash and one copy. Whether cutting
at added tokens gives the tokenizer's own result depends on its pre-tokenizer (a SentencePiece
``Metaspace`` that adds its space only at the start of the text does not): each Hugging Face
tokenizer is checked on sample prompts when loaded, and one that fails is used uncut (exact,
slower) with a warning.
"""

from __future__ import annotations

import array
import json
import logging
import re
import sys
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
import xxhash

import scheduling.lig_sim_tokenizer as sim
from scheduling.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from scheduling.token_blocks import PromptTokenizer
from shared.errors import ConfigError

log = logging.getLogger("lig.scheduling.tokenizers")

BUILTIN_SIM = "builtin:lig-sim"
BUILTINS = (BUILTIN_SIM,)
DEFAULT_CACHE_TOKENS = 4_000_000  # 16 MB of token ids (4 bytes each) per pool
DEFAULT_CACHE_ENTRIES = 65_536
DEFAULT_MAX_TOKENS = 65_536  # the router looks up 2,048 blocks at most: 32 tokens each
# Chat with more messages falls back unrendered: a template's loop costs each message (~4 us for
# ChatML), and a 32 MiB body holds a million tiny ones; real conversations stay far below.
MAX_CHAT_MESSAGES = 8_192

_hash128 = xxhash.xxh3_128_intdigest

# Long text is cut into chunks of about this many characters, so that two prompts sharing a
# long prefix share all its chunks but the last: each cut is the first place at least this far
# into the rest where one space stands between a non-space and a letter. Word-level
# pre-tokenizers (GPT-2 / Llama 3 / Qwen byte-level, Metaspace) start a word there, so no token
# spans it; the load-time check verifies it per tokenizer.
CHUNK_CHARS = 1024
_CHUNK_CUT = re.compile(r"(?<=\S) (?=[^\W\d_])")


class TokenizerLoadError(ConfigError):
    """A tokenizer that cannot be loaded (the message names the file and the reason)."""


def _key(text: str) -> int:
    return _hash128(text.encode("utf-8", "surrogatepass"))


class IdsCache:
    """Token ids of text pieces, least recently used dropped first, bounded in entries and in
    tokens held (4 bytes each)."""

    def __init__(self, max_tokens: int = DEFAULT_CACHE_TOKENS,
                 max_entries: int = DEFAULT_CACHE_ENTRIES) -> None:
        self._entries: OrderedDict[int, array.array[int]] = OrderedDict()
        self._max_tokens = max_tokens
        self._max_entries = max_entries
        self.tokens = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: int) -> array.array[int] | None:
        """The ids filed under ``key`` (now most recently used), or None."""
        ids = self._entries.get(key)
        if ids is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return ids

    def put(self, key: int, ids: array.array[int]) -> None:
        """File ``ids`` under ``key``; a piece larger than the whole cache is not kept."""
        if len(ids) > self._max_tokens or key in self._entries:
            return
        self._entries[key] = ids
        self.tokens += len(ids)
        while self.tokens > self._max_tokens or len(self._entries) > self._max_entries:
            _, dropped = self._entries.popitem(last=False)
            self.tokens -= len(dropped)


def _token_id_prompt(ids: Sequence[Any]) -> array.array[int] | None:
    """A prompt of token ids as uint32s; None when one is not an id (negative, too large, not an
    int), which the engine would refuse anyway."""
    try:
        return array.array("I", ids)
    except (TypeError, OverflowError):
        return None


# A message's content: its string, or the texts of its content parts (none for no content).
Content = str | list[str]


def _message_content(content: object) -> Content | None:
    """A message's content; None for any non-text part (an image, audio)."""
    if content is None:
        return []
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts: list[str] = []
    for part in content:
        text = getattr(part, "text", None)
        if getattr(part, "type", None) != "text" or not isinstance(text, str):
            return None
        texts.append(text)
    return texts


def content_text(content: Content) -> str:
    """The content as the engine's "string" content format sees it: parts joined by newlines."""
    return content if isinstance(content, str) else "\n".join(content)


def chat_turns(messages: object) -> list[tuple[str, Content]] | None:
    """(role, content) of each chat message (``scheduling.prompt.Message``); None when a
    message has a non-text part or the list is empty."""
    if not isinstance(messages, list) or not messages:
        return None
    turns: list[tuple[str, Content]] = []
    for message in messages:
        role = getattr(message, "role", None)
        content = _message_content(getattr(message, "content", None))
        if not isinstance(role, str) or content is None:
            return None
        turns.append((role, content))
    return turns


class _Tokenizer:
    """What every pool tokenizer shares: reading the request, token-id prompts, the cache."""

    def __init__(self, cache: IdsCache | None = None,
                 max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.cache = cache if cache is not None else IdsCache()
        # Only a prompt's first blocks are looked up; tokenizing the rest of a huge prompt would
        # hold the event loop for nothing. Cut pieces stop past this many tokens (whole-text
        # tokenizers, which cannot stop early, are not bounded).
        self.max_tokens = max_tokens
        self.refused = 0  # requests answered None (fallback to the approximate index)

    def prompt_token_ids(self, prompt: object, messages: object) -> Sequence[int] | None:
        """Token ids of chat ``messages`` when given, else of the completion ``prompt``."""
        if messages is not None:
            turns = chat_turns(messages)
            ids = self._chat(turns) if turns is not None else None
        elif isinstance(prompt, str):
            ids = self._completion(prompt)
        elif isinstance(prompt, list) and prompt:
            first = prompt[0]
            if isinstance(first, int):
                ids = _token_id_prompt(prompt)
            elif isinstance(first, str):
                ids = self._completion(first)
            elif isinstance(first, list):
                ids = _token_id_prompt(first)
            else:
                ids = None
        else:
            ids = None
        if ids is None:
            self.refused += 1
        return ids

    def _cached(self, text: str) -> array.array[int] | None:
        """Ids of ``text`` (see :meth:`_extend`); always a new array (callers may extend it;
        the cached ones stay as they are)."""
        ids = array.array("I")
        return ids if self._extend(ids, text) else None

    def _extend(self, ids: array.array[int], text: str) -> bool:
        """Append the ids of ``text`` to ``ids``, a long text in chunks (:data:`CHUNK_CHARS`),
        each through the cache, until ``ids`` holds :attr:`max_tokens`; False when the text
        cannot be tokenized."""
        start = 0
        while start < len(text) and len(ids) < self.max_tokens:
            end = len(text)
            if end - start > CHUNK_CHARS:
                cut = _CHUNK_CUT.search(text, start + CHUNK_CHARS)
                if cut is not None:
                    end = cut.start()
            piece = self._cached_piece(text[start:end])
            if piece is None:
                return False
            ids += piece
            start = end
        return True

    def _cached_piece(self, text: str) -> array.array[int] | None:
        key = _key(text)
        ids = self.cache.get(key)
        if ids is None:
            ids = self._encode_piece(text)
            if ids is None:
                return None
            self.cache.put(key, ids)
        return ids

    def _encode_piece(self, text: str) -> array.array[int] | None:
        raise NotImplementedError

    def _completion(self, text: str) -> array.array[int] | None:
        raise NotImplementedError

    def _chat(self, turns: list[tuple[str, Content]]) -> array.array[int] | None:
        raise NotImplementedError


class SimTokenizer(_Tokenizer):
    """``builtin:lig-sim``: ``lig sim``'s tokenizer and chat template, cached per message."""

    def __init__(self, cache: IdsCache | None = None,
                 max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        super().__init__(cache, max_tokens)
        self._opening = array.array("I", sim.encode(sim.ASSISTANT_OPENING))

    def _encode_piece(self, text: str) -> array.array[int]:
        return array.array("I", sim.encode(text))

    def _completion(self, text: str) -> array.array[int] | None:
        return self._cached(text)

    def _chat(self, turns: list[tuple[str, Content]]) -> array.array[int] | None:
        ids = array.array("I")
        for role, content in turns:
            if not self._extend(ids, sim.render_turn(role, content_text(content))):
                return None
            if len(ids) >= self.max_tokens:
                return ids  # the turn may have been cut short: nothing after it
        ids += self._opening
        return ids


# Templates that loop over a message's content parts get them as a list of dicts (vLLM's
# "openai" content format); the others a string of the text parts joined by newlines.
_LOOPS_OVER_CONTENT = re.compile(
    r"for\s+\w+\s+in\s+\w+(?:\[\s*['\"]content['\"]\s*\]|\.content\b)")

# Sample prompts the cutting at added tokens is checked on when a tokenizer is loaded: spaces,
# newlines, digits, punctuation and non-ASCII text at both ends of pieces.
_SAMPLE_TEXTS = (
    "Hello world", " leading space", "two  spaces\n\nnew lines\t tabs ",
    "numbers 12345 and 3.14159, punctuation!? (yes) <b>tags</b> caf\u00e9 na\u00efve \u65e5\u672c",
)
# Text on both sides of a chunk cut: every pair (left, " " + right starting with a letter) is
# checked, and a long text of them all is cut into chunks.
_SAMPLE_FRAGMENTS = (
    "The quick brown fox", "jumps over 12345 lazy dogs.", "Caf\u00e9 na\u00efve r\u00e9sum\u00e9",
    "\u65e5\u672c\u8a9e \u30c6\u30ad\u30b9\u30c8", "it's (really) fine!", "tabs\tand\nnew lines",
    "a  double  space", "x", "\u00c9t\u00e9", "UPPER lower", "#tag @user", "end\n", "don't")
_SAMPLE_LONG = " ".join(_SAMPLE_FRAGMENTS[index % len(_SAMPLE_FRAGMENTS)]
                        for index in range(CHUNK_CHARS // 4))
_SAMPLE_CHATS = (
    [("system", "You are a helpful assistant.\n\nRules: 1) be brief  2) cite 12345 sources"),
     ("user", "  Hello, w\u00f6rld! <tags> end  "), ("assistant", "Hi there."),
     ("user", "\n\nWhat is 3.14159 * 2?\t")],
    [("user", "Hello"), ("assistant", " Hi! "), ("user", "caf\u00e9  \n")],
)


class HFTokenizer(_Tokenizer):
    """A Hugging Face ``tokenizers.Tokenizer`` and, for chat, its model's chat template."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, template: ChatTemplate | None,
                 name: str = "", cache: IdsCache | None = None,
                 max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        super().__init__(cache, max_tokens)
        tokenizer.no_truncation()  # the engine refuses an over-long prompt rather than cut it
        tokenizer.no_padding()
        self._tokenizer = tokenizer
        self.template = template
        self.name = name
        self._openai_content = bool(template and _LOOPS_OVER_CONTENT.search(template.source))
        added = tokenizer.get_added_tokens_decoder()
        self._special_ids = {token.content: token_id for token_id, token in added.items()}
        # Added tokens that swallow the whitespace before (lstrip) or after (rstrip) them.
        self._lstrip = {token.content for token in added.values() if token.lstrip}
        self._rstrip = {token.content for token in added.values() if token.rstrip}
        self._splitter = self._added_token_pattern(added.values())
        self._around = self._post_processor_ids()
        self.cut = self._around is not None and self._cutting_is_exact()
        if not self.cut:
            log.warning("tokenizer %s: cutting prompts at its added tokens does not give its own "
                        "token ids (its pre-tokenizer or post-processor depends on the position "
                        "in the text); every prompt is tokenized whole (exact, slower)", name)

    @staticmethod
    def _added_token_pattern(added: Any) -> re.Pattern[str] | None:
        """The added tokens as one alternation of literals, longest first (the tokenizer takes
        the longest match). Plain literals let the regex engine scan for their first
        characters: with groups or a leading ``\\s*`` a 4,000-token prompt took 3 ms."""
        contents = sorted({token.content for token in added if token.content},
                          key=lambda content: -len(content))
        if not contents:
            return None
        return re.compile("|".join(re.escape(content) for content in contents))

    def _post_processor_ids(self) -> tuple[list[int], list[int]] | None:
        """The ids the post-processor puts before and after one sequence (a BOS, an EOS), or
        None when they are not simply around it."""
        probe = "hello world"
        bare = self._tokenizer.encode(probe, add_special_tokens=False).ids
        full = self._tokenizer.encode(probe, add_special_tokens=True).ids
        for start in range(len(full) - len(bare) + 1):
            if full[start:start + len(bare)] == bare:
                return full[:start], full[start + len(bare):]
        return None

    def _cutting_is_exact(self) -> bool:
        """Whether the cut and cached tokenization gives the tokenizer's own ids on the samples
        (chat samples rendered with the template, when there is one)."""
        bound, self.max_tokens = self.max_tokens, sys.maxsize  # compare whole prompts
        try:
            return self._samples_match()
        finally:
            self.max_tokens = bound

    def _samples_match(self) -> bool:
        specials = list(self._special_ids)[:3]
        texts = [*_SAMPLE_TEXTS, _SAMPLE_LONG, *(f"{text}{token}{text}" for token in specials
                                                 for text in (*_SAMPLE_TEXTS[:2], _SAMPLE_LONG))]
        for text in texts:
            whole = self._tokenizer.encode(text, add_special_tokens=True).ids
            if self._cut_completion(text) != array.array("I", whole):
                return False
        for left in _SAMPLE_FRAGMENTS:
            for right in _SAMPLE_FRAGMENTS:
                if _CHUNK_CUT.match(f"{left} {right}", len(left)) is None:
                    continue  # not a place chunks are cut at
                whole = self._tokenizer.encode(f"{left} {right}", add_special_tokens=False).ids
                cut = (self._tokenizer.encode(left, add_special_tokens=False).ids
                       + self._tokenizer.encode(" " + right, add_special_tokens=False).ids)
                if whole != cut:
                    return False
        if self.template is None:
            return True
        for turns in (*_SAMPLE_CHATS, [("user", _SAMPLE_LONG)]):
            try:
                rendered = self.template.render(self._template_messages(turns))
            except jinja2.TemplateError:
                continue  # this template refuses these roles; the other sample decides
            whole = self._tokenizer.encode(rendered, add_special_tokens=False).ids
            if self._cut_ids(rendered) != array.array("I", whole):
                return False
        return True

    def _encode_piece(self, text: str) -> array.array[int] | None:
        return self._whole(text, False)

    def _cut_ids(self, text: str) -> array.array[int] | None:
        """Ids of ``text`` without the post-processor's tokens, cut at added tokens, each
        piece through the cache."""
        if self._splitter is None:
            return self._cached(text)
        ids = array.array("I")
        start = 0
        for match in self._splitter.finditer(text):
            if match.start() < start:
                continue  # inside the whitespace an rstrip token swallowed
            token = match.group()
            piece_text = text[start:match.start()]
            if token in self._lstrip:
                piece_text = piece_text.rstrip()
            if not self._extend(ids, piece_text):
                return None
            if len(ids) >= self.max_tokens:
                return ids  # the piece may have been cut short: nothing after it
            ids.append(self._special_ids[token])
            start = match.end()
            if token in self._rstrip:
                while start < len(text) and text[start].isspace():
                    start += 1
        return ids if self._extend(ids, text[start:]) else None

    def _cut_completion(self, text: str) -> array.array[int] | None:
        body = self._cut_ids(text)
        if body is None or self._around is None:
            return None
        before, after = self._around
        # A prompt cut short at max_tokens does not end here: nothing after it.
        return array.array("I", before) + body + array.array(
            "I", after if len(body) < self.max_tokens else ())

    def _whole(self, text: str, add_special_tokens: bool) -> array.array[int] | None:
        try:
            # Without offsets: half the CPU of encode() on long text (bench/bench_tokenize.py).
            ids = self._tokenizer.encode_batch_fast(
                [text], add_special_tokens=add_special_tokens)[0].ids
        except Exception:  # e.g. lone surrogates: no ids, the router falls back
            return None
        return array.array("I", ids)

    def _completion(self, text: str) -> array.array[int] | None:
        return self._cut_completion(text) if self.cut else self._whole(text, True)

    def _template_messages(self, turns: Sequence[tuple[str, Content]]) -> list[dict[str, Any]]:
        if self._openai_content:
            return [{"role": role, "content": [
                {"type": "text", "text": text}
                for text in ([content] if isinstance(content, str) else content)]}
                for role, content in turns]
        return [{"role": role, "content": content_text(content)} for role, content in turns]

    def _chat(self, turns: list[tuple[str, Content]]) -> array.array[int] | None:
        if self.template is None or len(turns) > MAX_CHAT_MESSAGES:
            return None
        try:
            rendered = self.template.render(self._template_messages(turns))
        except Exception:  # a template may raise anything; the router falls back
            return None
        return self._cut_ids(rendered) if self.cut else self._whole(rendered, False)


def load_prompt_tokenizer(spec: str) -> PromptTokenizer:
    """The tokenizer ``spec`` names: ``builtin:lig-sim``, or a Hugging Face ``tokenizer.json``
    file (or a directory holding one), with ``tokenizer_config.json`` / ``chat_template.jinja``
    beside it for chat. Raises :class:`TokenizerLoadError` saying what is wrong."""
    if spec.startswith("builtin:"):
        if spec == BUILTIN_SIM:
            return SimTokenizer()
        raise TokenizerLoadError(f"unknown built-in tokenizer {spec!r} (known: "
                                 f"{', '.join(BUILTINS)})")
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerLoadError(f"{path}: no such file (a tokenizer.json, a directory holding "
                                 f"one, or {BUILTIN_SIM})")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust side raises a plain Exception
        raise TokenizerLoadError(f"{path}: not a tokenizers tokenizer.json: {error}") from None
    config = _read_config(path.parent / "tokenizer_config.json")
    try:
        template = load_chat_template(path.parent, config)
    except ChatTemplateError as error:
        raise TokenizerLoadError(f"{path.parent}: {error}") from None
    return HFTokenizer(tokenizer, template, name=str(path))


def _read_config(path: Path) -> Mapping[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise TokenizerLoadError(f"{path}: not readable JSON: {error}") from None
    if not isinstance(config, dict):
        raise TokenizerLoadError(f"{path}: not a JSON object")
    return config


def parse_pool_specs(values: Sequence[str]) -> dict[str, str]:
    """``POOL=SPEC`` items as a mapping; raises ``ValueError`` on a malformed item or a pool
    named twice."""
    specs: dict[str, str] = {}
    for value in values:
        pool, sep, spec = value.partition("=")
        pool, spec = pool.strip(), spec.strip()
        if not sep or not pool or not spec:
            raise ValueError(f"{value!r} is not POOL=PATH or POOL={BUILTIN_SIM}")
        if pool in specs:
            raise ValueError(f"pool {pool!r} is given two tokenizers")
        specs[pool] = spec
    return specs


def load_pool_tokenizers(specs: Mapping[str, str]) -> dict[str, PromptTokenizer]:
    """One tokenizer per pool (see :func:`load_prompt_tokenizer`); the first that cannot be
    loaded raises :class:`TokenizerLoadError` naming its pool."""
    loaded: dict[str, PromptTokenizer] = {}
    for pool, spec in specs.items():
        try:
            loaded[pool] = load_prompt_tokenizer(spec)
        except TokenizerLoadError as error:
            raise TokenizerLoadError(f"pool {pool}: {error}") from None
    return loaded
