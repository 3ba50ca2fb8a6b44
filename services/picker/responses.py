"""Responses on their way back: put the client's model name back, and read token usage.

When the picker resolved a requested name to a different target model, the model server answers
with the target's name; the client must see the name it asked for. Plain JSON bodies are
rewritten whole; Server-Sent Events are rewritten line by line as chunks pass, holding back only
an incomplete last line.

Usage may carry ``prompt_tokens_details.cached_tokens``: the prompt tokens the model server found
in its prefix cache (vLLM reports it with ``--enable-prompt-tokens-details``; the details are null
or absent otherwise). Any other detail, or a detail of the wrong type, is ignored rather than
costing the token counts.
"""

from __future__ import annotations

import msgspec


class Usage(msgspec.Struct):
    """Token counts from an OpenAI-style ``usage`` object; ``cached_tokens`` is
    ``prompt_tokens_details.cached_tokens`` (None: not reported)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None


class _WireUsage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Decoded untyped: a server's odd details must not fail the whole usage (see _cached).
    prompt_tokens_details: object = None


class _UsageHolder(msgspec.Struct):
    usage: _WireUsage | None = None


def _cached(details: object) -> int | None:
    """``cached_tokens`` of a ``prompt_tokens_details`` object, when it is a count."""
    if not isinstance(details, dict):
        return None
    cached = details.get("cached_tokens")
    # bool is an int subclass; a JSON true is no count.
    return cached if type(cached) is int and cached >= 0 else None


_decode_usage = msgspec.json.Decoder(_UsageHolder).decode
_USAGE_KEY = b'"usage"'
_MODEL_KEY = b'"model"'
_DATA = b"data:"


class ResponseRewriter:
    """Feeds response body chunks through; rewrites ``model`` to ``requested`` if it is set.

    :meth:`feed` returns the bytes to send instead of the chunk, or None to pass it unchanged.
    With ``requested=None`` nothing is rewritten and only ``usage`` is read.
    """

    def __init__(self, requested: str | None, sse: bool) -> None:
        self.requested = requested
        self.sse = sse
        self.usage: Usage | None = None
        self._held: list[bytes] = []
        self._tail = b""

    def feed(self, chunk: bytes, end: bool) -> bytes | None:
        """Process one chunk (``end`` marks the last); see the class docstring for the result."""
        return self._feed_sse(chunk, end) if self.sse else self._feed_json(chunk, end)

    def _feed_json(self, chunk: bytes, end: bool) -> bytes | None:
        self._held.append(chunk)
        if not end:
            # Rewriting needs the whole document: hold the chunk back (send nothing for now).
            return b"" if self.requested is not None else None
        body = self._held[0] if len(self._held) == 1 else b"".join(self._held)
        self._held = []
        rewritten = self._rewrite_document(body)
        if rewritten is not None:
            return rewritten
        if self.requested is not None and body is not chunk:
            return body  # earlier chunks were held back
        return None

    def _rewrite_document(self, body: bytes) -> bytes | None:
        """Read usage; return the rewritten document, or None when it stays as it is."""
        if self.requested is None:
            if _USAGE_KEY in body:
                self._read_usage(body)
            return None
        try:
            document = msgspec.json.decode(body)
        except msgspec.DecodeError:
            return None
        if not isinstance(document, dict):
            return None
        usage = document.get("usage")
        if isinstance(usage, dict):
            self._take_usage(usage)
        model = document.get("model")
        if not isinstance(model, str) or model == self.requested:
            return None
        document["model"] = self.requested
        return msgspec.json.encode(document)

    def _feed_sse(self, chunk: bytes, end: bool) -> bytes | None:
        data = self._tail + chunk if self._tail else chunk
        if end:
            complete, self._tail = data, b""
        else:
            cut = data.rfind(b"\n") + 1
            complete, self._tail = data[:cut], data[cut:]
        if self.requested is None:
            if _USAGE_KEY in complete:
                for line in complete.split(b"\n"):
                    if _USAGE_KEY in line and line.startswith(_DATA):
                        self._read_usage(line[5:])
            return None
        if _MODEL_KEY not in complete and _USAGE_KEY not in complete:
            return None if complete is chunk else complete
        return b"\n".join(self._rewrite_line(line) for line in complete.split(b"\n"))

    def _rewrite_line(self, line: bytes) -> bytes:
        if not line.startswith(_DATA) or (_MODEL_KEY not in line and _USAGE_KEY not in line):
            return line
        suffix = b"\r" if line.endswith(b"\r") else b""
        rewritten = self._rewrite_document(line[5:].strip())
        return line if rewritten is None else b"data: " + rewritten + suffix

    def _read_usage(self, document: bytes) -> None:
        try:
            usage = _decode_usage(document).usage
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if usage is not None:
            self.usage = Usage(usage.prompt_tokens, usage.completion_tokens,
                               _cached(usage.prompt_tokens_details))

    def _take_usage(self, usage: dict[str, object]) -> None:
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            self.usage = Usage(prompt, completion, _cached(usage.get("prompt_tokens_details")))
