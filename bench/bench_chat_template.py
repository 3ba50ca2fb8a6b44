"""What the chat template's bounds (scheduling/chat_template.py) cost per render: the bounded
sandbox against Jinja's plain immutable sandbox with the same options, on a ChatML template
(tests/support/hf_tokenizer.py) over chats of 2, 20 and 200 messages; medians of ``--repeats``
runs of ``--number`` renders each, and their ratio, both measured in this run.

    PYTHONPATH=$PWD python bench/bench_chat_template.py [--repeats 9] [--number 500]
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from collections.abc import Callable

import jinja2.ext
import jinja2.sandbox

from scheduling.chat_template import ChatTemplate
from tests.support.hf_tokenizer import CHATML_TEMPLATE

TOKENS = {"bos_token": "<s>", "eos_token": "<|im_end|>"}


def _median_us(render: Callable[[], str], number: int, repeats: int) -> float:
    return statistics.median(timeit.repeat(render, number=number, repeat=repeats)) / number * 1e6


def main() -> None:
    """Print one line per chat size: plain and bounded microseconds per render, and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--number", type=int, default=500)
    args = parser.parse_args()
    plain = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
    ).from_string(CHATML_TEMPLATE)
    bounded = ChatTemplate(CHATML_TEMPLATE, TOKENS)
    print("messages  plain_us  bounded_us  ratio")
    for size in (2, 20, 200):
        messages = [{"role": ("user", "assistant")[index % 2],
                     "content": "hello there, how are you today? " * 8} for index in range(size)]

        def render_plain(messages: list[dict[str, str]] = messages) -> str:
            return plain.render(messages=messages, add_generation_prompt=True, tools=None,
                                documents=None, **TOKENS)

        def render_bounded(messages: list[dict[str, str]] = messages) -> str:
            return bounded.render(messages)

        assert render_plain() == render_bounded()
        number = max(args.number * 20 // (size + 18), 10)
        base = _median_us(render_plain, number, args.repeats)
        ours = _median_us(render_bounded, number, args.repeats)
        print(f"{size:8d}  {base:8.1f}  {ours:10.1f}  {ours / base:5.2f}x")


if __name__ == "__main__":
    main()
