"""A PromptTokenizer over the simulator's tokenizer and chat template (``simulator/tokenizer.py``),
for tests of precise prefix routing until the per-pool tokenizers (issue 16's tokenizer work)
are merged: it gives the token ids ``lig sim`` computes for the same request."""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.prompt import Message
from simulator import tokenizer


class SimTokenizer:
    """The simulator's tokenization of a completion prompt or of chat messages; None for what
    the simulator would refuse (batches of several prompts, non-text content)."""

    def prompt_token_ids(self, prompt: object, messages: object) -> Sequence[int] | None:
        """Token ids of ``prompt`` (text, token ids, a batch of one) or of ``messages``."""
        if messages is not None:
            return self._chat(messages)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(type(item) is int for item in prompt):
            return prompt
        return None

    @staticmethod
    def _chat(messages: object) -> Sequence[int] | None:
        if not isinstance(messages, list) or not messages:
            return None
        turns = []
        for message in messages:
            if not isinstance(message, Message):
                return None
            content = message.content
            if content is None:
                content = ""
            elif not isinstance(content, str):
                if any(part.type != "text" for part in content):
                    return None
                content = "\n".join(part.text or "" for part in content)
            turns.append((message.role, content))
        return tokenizer.encode(tokenizer.render_chat(turns))
