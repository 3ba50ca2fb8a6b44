"""The OpenAI-style request and response bodies vLLM's server reads and writes, as pure functions.

Requests: ``parse_completion`` validates a ``/v1/completions`` or ``/v1/chat/completions`` body
and tokenizes its prompt (``tokenizer``). Unknown fields are ignored, as vLLM does; fields the
simulator cannot honour (several prompts, ``n`` > 1) are refused with a 400.

Responses: whole bodies and server-sent-event chunks shaped like vLLM's (``id``, ``object``,
``created``, ``model``, ``choices``, ``usage``); errors as vLLM's ``ErrorResponse``:
``{"error": {"message", "type", "param", "code"}}`` with ``code`` the HTTP status.
"""

from __future__ import annotations

from typing import Any

import msgspec

from scheduling import lig_sim_tokenizer as tokenizer
from scheduling.prompt import CompletionPrompt, Message
from scheduling.token_blocks import PromptTokenizer
from shared.errors import LigError

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    408: "BadRequestError",
    413: "BadRequestError",
    431: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

_json = msgspec.json.Encoder()


class ApiError(LigError):
    """A request the server answers with an error body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_body(status: int, message: str) -> bytes:
    """vLLM's error body for HTTP ``status``."""
    return _json.encode(
        {
            "error": {
                "message": message,
                "type": _ERROR_TYPES.get(status, "BadRequestError"),
                "param": None,
                "code": status,
            }
        }
    )


class CompletionCall(msgspec.Struct, frozen=True):
    """A validated completion request."""

    chat: bool
    model: str
    prompt: tuple[int, ...]
    max_tokens: int | None
    stream: bool
    include_usage: bool


class _PromptFields(msgspec.Struct):
    """The prompt as a ``PromptTokenizer`` reads it (the picker's own types)."""

    prompt: CompletionPrompt | None = None
    messages: list[Message] | None = None


def parse_completion(body: bytes, chat: bool, default_model: str,
                     prompt_tokenizer: PromptTokenizer | None = None) -> CompletionCall:
    """Validate a completion body; raises ``ApiError`` (400) saying what is wrong. The prompt's
    token ids are the built-in tokenizer's, or ``prompt_tokenizer``'s (``lig sim --tokenizer``)
    once the body is valid."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as error:
        raise ApiError(400, f"request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = data.get("model")
    if model is None:
        model = default_model
    if not isinstance(model, str):
        raise ApiError(400, "model must be a string")
    prompt = _chat_prompt(data.get("messages")) if chat else _completion_prompt(data.get("prompt"))
    max_tokens = data.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = data.get("max_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise ApiError(400, "max_tokens must be a positive integer")
    n = data.get("n")
    if n is not None and n != 1:
        raise ApiError(400, "the simulator generates one choice per request (n must be 1)")
    stream = data.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise ApiError(400, "stream must be a boolean")
    options = data.get("stream_options")
    if options is not None:
        if not stream:
            raise ApiError(400, "Stream options can only be defined when `stream=True`.")
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object")
    include_usage = bool(options and options.get("include_usage"))
    if prompt_tokenizer is not None:
        prompt = _tokenized(data, chat, prompt_tokenizer)
    return CompletionCall(
        chat=chat,
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=bool(stream),
        include_usage=include_usage,
    )


def _completion_prompt(prompt: Any) -> tuple[int, ...]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(_is_token(item) for item in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "the simulator serves one prompt per request")
    raise ApiError(400, "prompt must be a string or a list of token ids")


def _tokenized(data: dict[str, Any], chat: bool,
               prompt_tokenizer: PromptTokenizer) -> tuple[int, ...]:
    """The prompt's token ids by ``prompt_tokenizer`` (the body was validated already)."""
    try:
        fields = msgspec.convert(data, _PromptFields)
    except msgspec.ValidationError as error:
        raise ApiError(400, f"prompt: {error}") from None
    ids = prompt_tokenizer.prompt_token_ids(None if chat else fields.prompt,
                                            fields.messages if chat else None)
    if ids is None:
        raise ApiError(400, "the prompt cannot be tokenized by --tokenizer (non-text content, "
                            "or chat without a chat template)")
    return tuple(ids)


def _is_token(item: Any) -> bool:
    return isinstance(item, int) and not isinstance(item, bool) and item >= 0


def _chat_prompt(messages: Any) -> tuple[int, ...]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    turns: list[tuple[str, str]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{index}] must be an object with a string role")
        turns.append((message["role"], _content_text(message.get("content"), index)))
    return tokenizer.encode(tokenizer.render_chat(turns))


def _content_text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ApiError(400, f"messages[{index}]: only text content parts are supported")
            texts.append(str(part.get("text", "")))
        return "\n".join(texts)
    raise ApiError(400, f"messages[{index}].content must be a string or a list of parts")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
          stream: bool = False) -> dict[str, Any]:
    """The ``usage`` object. ``cached_tokens`` (``--enable-prompt-tokens-details``; None: off)
    fills ``prompt_tokens_details`` as vLLM does: in full in a whole body, without its null
    fields in a stream's usage chunk (vLLM drops None there)."""
    details: dict[str, Any] | None = None
    if cached_tokens is not None:
        details = {"cached_tokens": cached_tokens} if stream else {
            "cached_tokens": cached_tokens, "created_cache_tokens": None,
            "multimodal_tokens": None}
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": details,
    }


class ResponseWriter:
    """Bodies and SSE chunks for one completion, sharing its id, creation time and model."""

    def __init__(self, call: CompletionCall, response_id: str, created: int) -> None:
        self.call = call
        self.id = response_id
        self.created = created

    def _envelope(self, object_type: str, choices: list[Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_type,
            "created": self.created,
            "model": self.call.model,
            "choices": choices,
        }

    def body(self, text: str, finish_reason: str | None, completion_tokens: int,
             cached_tokens: int | None = None) -> bytes:
        """The non-streaming response (``cached_tokens``: see :func:`usage`)."""
        call = self.call
        if call.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
            data = self._envelope("chat.completion", [choice])
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
            data = self._envelope("text_completion", [choice])
        data["usage"] = usage(len(call.prompt), completion_tokens, cached_tokens)
        return _json.encode(data)

    def _event(self, data: dict[str, Any]) -> bytes:
        if self.call.include_usage and "usage" not in data:
            data["usage"] = None
        return b"data: " + _json.encode(data) + b"\n\n"

    def role_chunk(self) -> bytes:
        """The first chat chunk, which opens the assistant's message."""
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._event(self._envelope("chat.completion.chunk", [choice]))

    def token_chunk(self, text: str, finish_reason: str | None) -> bytes:
        """One generated token's chunk; the last one carries the finish reason."""
        if self.call.chat:
            choice = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            return self._event(self._envelope("chat.completion.chunk", [choice]))
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        return self._event(self._envelope("text_completion", [choice]))

    def usage_chunk(self, completion_tokens: int, cached_tokens: int | None = None) -> bytes:
        """The final chunk with no choices and the usage (``stream_options.include_usage``;
        ``cached_tokens``: see :func:`usage`)."""
        object_type = "chat.completion.chunk" if self.call.chat else "text_completion"
        data = self._envelope(object_type, [])
        data["usage"] = usage(len(self.call.prompt), completion_tokens, cached_tokens, True)
        return self._event(data)

    @staticmethod
    def done() -> bytes:
        """The end of the stream."""
        return b"data: [DONE]\n\n"
