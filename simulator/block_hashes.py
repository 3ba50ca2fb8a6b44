"""What identifies a full KV block: a description of its tokens, and a hash chained over blocks.

A prompt is either token ids (``tuple[int, ...]``, from ``tokenizer.encode``) or a
``SyntheticPrompt`` (runs of ``(seed, length)``: equal seeds mean equal tokens, so a benchmark can
model shared system prompts without materialising ids). Generated tokens are the spec's
``output`` ids when given, otherwise unique to the request. Full blocks are identified by a hash
chained over the previous block's hash, the adapter and the block's content, so two requests
share a block's hash exactly when they share everything up to its end.
"""

from __future__ import annotations

import bisect

from simulator.request import Request


def hash_blocks(
    request: Request, count: int, block_size: int, adapter_keys: dict[str, int]
) -> None:
    """Extend ``request.block_hashes`` to its first ``count`` blocks; ``adapter_keys`` gives
    each adapter a number other than 0, which stands for the base model in the hashes."""
    hashes = request.block_hashes
    done = len(hashes)
    if done >= count:
        return
    adapter_key = adapter_keys.get(request.adapter, 0) if request.adapter else 0
    parent = hashes[-1] if hashes else adapter_key
    num_prompt = request.num_prompt_tokens
    ids = request._ids
    ends, keys = request._segment_ends, request._segment_keys
    segment = 0
    for start in range(done * block_size, count * block_size, block_size):
        end = start + block_size
        # Inlined fast paths of _content: whole blocks of prompt ids or of one segment.
        if end > num_prompt:
            content = _content(request, start, end)
        elif ids is not None:
            content = ids[start:end]
        else:
            while ends[segment] <= start:
                segment += 1
            if end <= ends[segment]:
                content = ("s", keys[segment], start - (ends[segment - 1] if segment else 0))
            else:
                content = _parts(request, start, end)
        parent = hash((parent, adapter_key, content))
        hashes.append(parent)


def token_ids(request: Request, start: int, end: int) -> tuple[int, ...]:
    """The token ids of tokens ``start:end`` of a request, or () when some are not known as ids
    (synthetic prompts, generated tokens with no ``output`` ids)."""
    num_prompt = request.num_prompt_tokens
    ids, output = request._ids, request.spec.output
    if (start < num_prompt and ids is None) or (end > num_prompt and output is None):
        return ()
    prompt_part = ids[start:min(end, num_prompt)] if ids is not None else ()
    if end <= num_prompt or output is None:
        return prompt_part
    return prompt_part + output[max(start, num_prompt) - num_prompt : end - num_prompt]


def _content(request: Request, start: int, end: int) -> tuple[object, ...]:
    """A hashable description of the full block of tokens ``start:end`` of a request."""
    num_prompt = request.num_prompt_tokens
    if end <= num_prompt:
        ids = request._ids
        if ids is not None:
            return ids[start:end]
        ends = request._segment_ends
        segment = bisect.bisect_right(ends, start)
        if end <= ends[segment]:
            offset = ends[segment - 1] if segment else 0
            return ("s", request._segment_keys[segment], start - offset)
    elif start >= num_prompt:
        output = request.spec.output
        first = start - num_prompt
        if output is not None:
            return output[first : end - num_prompt]
        return ("o", request.serial, first)
    return _parts(request, start, end)


def _parts(request: Request, start: int, end: int) -> tuple[object, ...]:
    """The content of a block that straddles prompt segments or the prompt's end.

    Token ids stay one flat tuple across the prompt's end, so that the same tokens sent back as
    the next prompt (a multi-turn chat) describe the block the same way.
    """
    num_prompt = request.num_prompt_tokens
    ids, output = request._ids, request.spec.output
    if ids is not None and output is not None:
        return ids[start:num_prompt] + output[: end - num_prompt]
    parts: list[object] = []
    stop = min(end, num_prompt)
    if ids is not None:
        parts.append(ids[start:stop])
    else:
        ends = request._segment_ends
        starts = [0, *ends[:-1]]
        for key, first, last in zip(request._segment_keys, starts, ends, strict=True):
            low, high = max(start, first), min(stop, last)
            if low < high:
                parts.append(("s", key, low - first, high - first))
    if end > num_prompt:
        first, last = max(start, num_prompt) - num_prompt, end - num_prompt
        parts.append(("o", request.serial, first, last) if output is None else output[first:last])
    return tuple(parts)
