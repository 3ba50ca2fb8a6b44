"""The chaos tool's judgements without a stack: how a streamed answer is read (a chunk naming
another model, a stream cut before ``data: [DONE]``), and how a picker's precise index is judged
against the witness's truth; the soak's unique prompts and its memory growth over the last
third."""

from __future__ import annotations

import httpx
import pytest

from resilience.chaos import index_figure
from resilience.load import LoadRun, _one, unique_prompt
from resilience.soak import GROWTH_TARGET_PCT, growth_pct, last_third, memory_figures
from resilience.stack import SPLIT_MODEL
from scheduling.lig_sim_tokenizer import encode
from scheduling.prefix_hash import BLOCK_BYTES
from simulator.tokenizer import WORDS


def _sse(*models: str, done: bool = True) -> bytes:
    chunks = [f'data: {{"model": "{model}", "choices": []}}\n\n' for model in models]
    return ("".join(chunks) + ("data: [DONE]\n\n" if done else "")).encode()


@pytest.mark.parametrize(("body", "wrong", "lost"), [
    (_sse(SPLIT_MODEL, SPLIT_MODEL), 0, 0),
    (_sse(SPLIT_MODEL, "tweet-summary-1"), 1, 0),  # issue 26: the rewrite stopped mid-stream
    (_sse(SPLIT_MODEL, done=False), 0, 1),
])
async def test_streamed_chunks_are_checked(body: bytes, wrong: int, lost: int) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        assert b'"stream":true' in request.read()
        return httpx.Response(200, content=body)

    run = LoadRun()
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        await _one(client, "http://gateway", "stream", SPLIT_MODEL, 0, run)
    assert (len(LoadRun.wrong_model(run.outcomes)), len(LoadRun.lost(run.outcomes))) == (
        wrong, lost)
    assert run.split_streams == 0  # no longer in flight
    if lost:
        assert LoadRun.causes(run.outcomes) == "stream cut x1"


@pytest.mark.parametrize(("state", "truth", "passed", "held"), [
    ((1000, 0), 1015, True, "within"),
    ((1000, 1), 1015, True, "within + incomplete"),
    ((600, 2), 1000, True, "incomplete"),
    ((600, 0), 1000, False, "neither"),
    ((0, 0), 0, True, "within"),
    ((5, 0), 0, False, "neither"),
])
def test_an_index_is_within_two_percent_or_marked_incomplete(
        state: tuple[int, int], truth: int, passed: bool, held: str) -> None:
    figure = index_figure("nats", "picker-0", state, truth, 10.0)
    assert figure.passed is passed
    assert figure.value.endswith(f": {held}"), figure
    assert figure.name == "picker-0 precise index 10 s after the fault"


def test_the_state_before_the_fault_is_shown() -> None:
    figure = index_figure("collector", "picker-0", (500, 0), 1000, 10.0, (400, 0), 800)
    assert figure.value == ("500 of 1000 true blocks (-50.0%), 0 pods incomplete: neither "
                            "(before the fault: -50.0%, 0 incomplete)")
    assert figure.passed is False  # an earlier fault's aftermath still misses the target


def test_an_unreadable_picker_misses() -> None:
    figure = index_figure("nats", "picker-1", None, 100, 10.0)
    assert (figure.value, figure.passed) == ("metrics unreadable", False)


def test_unique_prompts_share_not_even_their_first_block() -> None:
    prompts = [unique_prompt(index, 64) for index in (0, 1, len(WORDS), len(WORDS) ** 3, 10**6)]
    assert all(len(encode(prompt)) == 64 for prompt in prompts)  # one token a word
    assert len({encode(prompt)[:4] for prompt in prompts}) == len(prompts)
    assert unique_prompt(7, 64) == unique_prompt(7, 64)  # the same run twice sends the same
    assert len(unique_prompt(0)) > 8 * BLOCK_BYTES  # many approximate-index entries each


def test_the_last_third_is_judged_from_its_own_start() -> None:
    mib = 1 << 20
    samples = [(float(t), (50 + t) * mib) for t in range(7)]  # grows over the first two thirds
    samples += [(7.0, 56 * mib), (8.0, 57 * mib), (9.0, 56 * mib)]
    assert last_third(samples) == [56 * mib, 56 * mib, 57 * mib, 56 * mib]  # t >= 6
    assert growth_pct(last_third(samples)) == pytest.approx(100 / 56)
    growth, = (f for f in memory_figures("picker-0", samples, 9.0) if "last third" in f.name)
    assert growth.passed is True and growth.value.startswith("+1.8% (56.0 MiB -> peak 57.0")
    assert growth_pct([100, 100 + GROWTH_TARGET_PCT + 1]) == pytest.approx(3.0)
    assert growth_pct([100]) is None and growth_pct([]) is None
    missing, = memory_figures("picker-1", [], 9.0)
    assert missing.passed is False
