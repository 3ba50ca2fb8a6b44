"""Benchmark the picker's prompt tokenization for precise prefix routing (issue 16).

    .venv/bin/python bench/bench_tokenize.py [--runs 7] [--requests 200] [--tokens 4000]

Per request, a chat of a shared system prompt (about ``--tokens`` tokens) and a short user
question that differs every time, the case prefix caching is for. CPU time per request
(``time.process_time_ns``), medians over ``--runs`` interleaved runs of ``--requests`` requests:

- ``encode`` (the baseline, same run): one plain call of the tokenizer on the rendered prompt
  (``tokenizers.Tokenizer.encode``; ``scheduling.lig_sim_tokenizer.encode`` for
  ``builtin:lig-sim``);
  ``encode, no offsets``: ``encode_batch_fast`` of it alone, what the picker calls on a miss;
- ``ours``: ``prompt_token_ids`` (template, cut, cache) plus ``block_keys`` of the result (block
  size 16): everything the router pays before it looks the keys up; ``of which keys``: the
  ``block_keys`` part alone;
- ``ours, nothing shared``: the same with new random words as the system prompt every request
  (every piece a cache miss: the overhead over the plain call);
- ``completion, shared``: a completion prompt of the same text, shared prefix and different end
  (the cache holds the prefix's chunks, see ``CHUNK_CHARS``).

Tokenizers: ``builtin:lig-sim`` and a byte-level BPE ``tokenizer.json`` trained here on the
simulator's words (``tests/support/hf_tokenizer.py``; this machine cannot download a model's).
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import scheduling.lig_sim_tokenizer as sim
from bench.flags import at_least
from scheduling.prompt import Message
from scheduling.prompt_tokenizers import HFTokenizer, SimTokenizer, load_prompt_tokenizer
from scheduling.token_blocks import block_keys, root_key
from simulator.tokenizer import WORDS
from tests.support.hf_tokenizer import write_tokenizer

BLOCK_SIZE = 16
QUESTION_TOKENS = 60  # the chat's user turn, about: the system prompt is the rest of --tokens
# A tokenizer, its plain call, how a chat is rendered for it, and its offset-free call if any.
Subject = tuple[SimTokenizer | HFTokenizer, Callable[[str], list[int]],
                Callable[[list[Message]], str], Callable[[str], list[int]] | None]
ROOT = root_key(None)


def words(count: int, rng: random.Random) -> str:
    """``count`` of the simulator's words (one token each for both tokenizers, about)."""
    return " ".join(rng.choice(WORDS) for _ in range(count))


def cpu_us(call: Callable[..., object], *args: object) -> float:
    """CPU microseconds of ``call(*args)``."""
    start = time.process_time_ns()
    call(*args)
    return (time.process_time_ns() - start) / 1000


def run_once(name: str, subject: Subject, tokens: int, requests: int,
             seed: int) -> dict[str, list[float]]:
    """Per-request CPU microseconds of each case for ``requests`` requests."""
    tokenizer, plain, render, fast = subject
    rng = random.Random(seed)
    system = words(tokens - QUESTION_TOKENS, rng)
    times: dict[str, list[float]] = {case: [] for case in (
        "encode", "ours", "of which keys", "ours, nothing shared", "completion, shared")}
    for index in range(requests):
        question = f"question {index}: " + words(40, rng)
        chat = [Message("system", system), Message("user", question)]
        rendered = render(chat)
        times["encode"].append(cpu_us(plain, rendered))
        if fast is not None:
            times.setdefault("encode, no offsets", []).append(cpu_us(fast, rendered))

        def ours(messages: list[Message] = chat) -> None:
            ids = tokenizer.prompt_token_ids(None, messages)
            assert ids is not None
            block_keys(ids, BLOCK_SIZE, ROOT)

        times["ours"].append(cpu_us(ours))
        ids = tokenizer.prompt_token_ids(None, chat)
        assert ids is not None
        times["of which keys"].append(cpu_us(block_keys, ids, BLOCK_SIZE, ROOT))
        unique = [Message("system", words(tokens - QUESTION_TOKENS, rng)),
                  Message("user", question)]
        times["ours, nothing shared"].append(cpu_us(ours, unique))

        def completion(text: str = system + " " + question) -> None:
            ids = tokenizer.prompt_token_ids(text, None)
            assert ids is not None
            block_keys(ids, BLOCK_SIZE, ROOT)

        times["completion, shared"].append(cpu_us(completion))
    expected = plain(render([Message("system", system), Message("user", "last")]))
    got = tokenizer.prompt_token_ids(None, [Message("system", system), Message("user", "last")])
    assert list(got or ()) == list(expected), f"{name}: ids differ from the plain call"
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=at_least(1), default=7,
                        help="interleaved runs; medians of their medians (default: 7)")
    parser.add_argument("--requests", type=at_least(1), default=200,
                        help="requests per run and tokenizer (default: 200)")
    parser.add_argument("--tokens", type=at_least(QUESTION_TOKENS + 1), default=4000,
                        help="tokens of a request's chat, about; all but the last "
                        f"{QUESTION_TOKENS} are the shared system prompt (default: 4000)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as directory:
        hf = load_prompt_tokenizer(str(write_tokenizer(Path(directory) / "bpe")))
    assert isinstance(hf, HFTokenizer) and hf.template is not None and hf.cut
    hf_template = hf.template
    simulated = SimTokenizer()

    def hf_render(chat: list[Message]) -> str:
        return hf_template.render([{"role": m.role, "content": str(m.content)} for m in chat])

    def hf_plain(text: str) -> list[int]:
        return hf._tokenizer.encode(text, add_special_tokens=False).ids

    def hf_fast(text: str) -> list[int]:
        return hf._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def sim_render(chat: list[Message]) -> str:
        return sim.render_chat([(m.role, str(m.content)) for m in chat])

    def sim_plain(text: str) -> list[int]:
        return list(sim.encode(text))

    subjects: dict[str, Subject] = {
        "builtin:lig-sim": (simulated, sim_plain, sim_render, None),
        "tokenizer.json (byte-level BPE)": (hf, hf_plain, hf_render, hf_fast),
    }
    results: dict[str, dict[str, list[float]]] = {name: {} for name in subjects}
    for run in range(args.runs):
        for name, subject in subjects.items():
            times = run_once(name, subject, args.tokens, args.requests, run)
            for case, values in times.items():
                results[name].setdefault(case, []).append(statistics.median(values))

    system = words(args.tokens - QUESTION_TOKENS, random.Random(0))
    prompt_tokens = len(hf_plain(hf_render([Message("system", system)])))
    print(f"python {platform.python_version()}, {args.runs} runs x {args.requests} requests, "
          f"system prompt ~{args.tokens} tokens ({prompt_tokens} with the BPE), block size "
          f"{BLOCK_SIZE}; CPU us per request, median of run medians (ratio to encode)")
    for name, cases in results.items():
        print(f"\n{name}")
        base = statistics.median(cases["encode"])
        for case, medians in cases.items():
            value = statistics.median(medians)
            print(f"  {case:24s} {value:9.1f} us  x{value / base:.2f}")


if __name__ == "__main__":
    main()
