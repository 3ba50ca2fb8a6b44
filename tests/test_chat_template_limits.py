"""A hostile or broken chat template (``tokenizer_config.json`` is a file the operator copies from
a model repository) cannot hold the picker's loop or its memory: output, sizes and work are
bounded per render, and a render over a bound is refused like any template error (the router
then uses the approximate index)."""

from __future__ import annotations

import time
from pathlib import Path

import jinja2
import pytest

from scheduling.chat_template import MAX_RENDER_STEPS, MAX_RENDERED_CHARS, ChatTemplate
from scheduling.prompt import Message
from scheduling.prompt_tokenizers import MAX_CHAT_MESSAGES, HFTokenizer, load_prompt_tokenizer
from tests.support.hf_tokenizer import CHATML_TEMPLATE, write_tokenizer

HELLO = [{"role": "user", "content": "hello"}]
OVER = MAX_RENDERED_CHARS + 1024  # just past the bound: cheap enough to run unbounded
STEPS_OVER = MAX_RENDER_STEPS // 1000 + 10  # outer x 1,000 inner iterations

BOMBS = {
    "string repeat": f"{{{{ 'x' * {OVER} }}}}",
    "message repeat": f"{{{{ messages[0]['content'] * {OVER // 5} }}}}",
    "list repeat": f"{{{{ ([1] * {OVER})|length }}}}",
    "percent width": f"{{{{ '%0{OVER}d' % 1 }}}}",
    "percent star": f"{{{{ '%*d' % ({OVER}, 1) }}}}",
    "format filter": f"{{{{ '%0{OVER}d'|format(1) }}}}",
    "str.format width": f"{{{{ '{{:>{OVER}}}'.format(1) }}}}",
    "center filter": f"{{{{ 'x'|center({OVER}) }}}}",
    "ljust method": f"{{{{ 'x'.ljust({OVER}) }}}}",
    "batch fill": f"{{{{ ([1]|batch({OVER}, 0)|first)|length }}}}",
    "power": "{{ (7 ** 10000000) % 10 }}",
    "output loop": ("{% for i in range(100000) %}{% for m in messages %}"
                    f"{{{{ 'y' * {OVER // 50_000} }}}}{{% endfor %}}{{% endfor %}}"),
    "concat doubling": ("{% set ns = namespace(s='x') %}{% for i in range(26) %}"
                        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}"),
    "plus doubling": ("{% set ns = namespace(s='x') %}{% for i in range(26) %}"
                      "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}"),
    "list doubling": ("{% set ns = namespace(s=[1]) %}{% for i in range(26) %}"
                      "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}"),
    "join doubling": ("{% set ns = namespace(s='x') %}{% for i in range(26) %}"
                      "{% set ns.s = [ns.s, ns.s]|join %}{% endfor %}{{ ns.s|length }}"),
    "str.join doubling": ("{% set ns = namespace(s='x') %}{% for i in range(26) %}"
                          "{% set ns.s = ''.join([ns.s, ns.s]) %}{% endfor %}"
                          "{{ ns.s|length }}"),
    "replace filter": "{% set s = 'x' * 6000 %}{{ (s|replace('x', s))|length }}",
    "replace method": "{% set s = 'x' * 6000 %}{{ s.replace('x', s)|length }}",
    "nested ranges": (f"{{% for i in range({STEPS_OVER}) %}}{{% for j in range(1000) %}}"
                      "{% endfor %}{% endfor %}"),
}


@pytest.mark.parametrize("source", BOMBS.values(), ids=BOMBS.keys())
def test_a_template_over_a_bound_is_refused_quickly(source: str) -> None:
    template = ChatTemplate(source, {})
    started = time.perf_counter()
    with pytest.raises(jinja2.TemplateError, match="chat template"):
        template.render(HELLO)
    # Generous for a loaded machine: unbounded, these take seconds and hundreds of MB.
    assert time.perf_counter() - started < 5.0


def test_the_bounds_leave_real_templates_alone() -> None:
    """ChatML over a long conversation (5,000 messages, 1 MB) renders as before."""
    template = ChatTemplate(CHATML_TEMPLATE, {"bos_token": "<s>"})
    messages = [{"role": ("user", "assistant")[number % 2], "content": f"m{number} " * 50}
                for number in range(5000)]
    text = template.render(messages)
    assert text.startswith("<s><|im_start|>user\nm0 m0")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert text.count("<|im_start|>") == 5001
    assert ChatTemplate("{{ '%05d'|format(42) }}{{ '{:>4}'.format(7) }}{{ 'ab' * 3 }}"
                        "{{ 'x'|center(5) }}{{ 2 ** 10 }}{{ 'a' ~ 1 ~ none }}{{ 'b' + 'c' }}"
                        "{{ (['d'] + ['e'])|join('/') }}{{ 'fg'|replace('f', 'h') }}"
                        "{{ '-'.join(['i', 'j']) }}{{ 'kk'.replace('k', 'l') }}{{ 1 + 2 }}",
                        {}).render(HELLO) == "00042   7ababab  x  1024a1Nonebcd/ehg" \
        "i-jll3"


def test_the_budget_is_per_render() -> None:
    """Renders each get the whole budget (it is not used up across requests)."""
    loop = (f"{{% for i in range({MAX_RENDER_STEPS // 4000}) %}}{{% for j in range(1000) %}}"
            "{% endfor %}{% endfor %}ok")
    template = ChatTemplate(loop, {})
    assert [template.render(HELLO) for _ in range(8)] == ["ok"] * 8


def test_the_picker_tokenizer_falls_back_on_a_bomb(tmp_path: Path) -> None:
    """A tokenizer whose template blows up on some messages loads, and routes those requests
    by the approximate index (None) instead of hanging the picker."""
    path = write_tokenizer(tmp_path, template=(
        "{% if messages|length > 2 %}"
        f"{{% for i in range({STEPS_OVER}) %}}{{% for j in range(1000) %}}{{% endfor %}}"
        "{% endfor %}{% endif %}" + CHATML_TEMPLATE))
    tokenizer = load_prompt_tokenizer(str(path))
    assert tokenizer.prompt_token_ids(None, [Message("user", "hi")])
    started = time.perf_counter()
    assert tokenizer.prompt_token_ids(None, [Message("user", "a")] * 3) is None
    assert time.perf_counter() - started < 5.0


def test_a_conversation_of_too_many_messages_falls_back_without_rendering(
    tmp_path: Path
) -> None:
    """Rendering costs each message (about 4 us for ChatML): past MAX_CHAT_MESSAGES (far more
    than the 2,048 blocks looked up need) the tokenizer answers None at once."""
    tokenizer = load_prompt_tokenizer(str(write_tokenizer(tmp_path)))
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.prompt_token_ids(None, [Message("user", "x")] * MAX_CHAT_MESSAGES)
    template = tokenizer.template
    assert template is not None
    rendered: list[int] = []

    class Counting:
        source = template.source

        def render(self, messages: list[dict[str, object]]) -> str:
            rendered.append(len(messages))
            return template.render(messages)

    tokenizer.template = Counting()  # type: ignore[assignment]
    assert tokenizer.prompt_token_ids(None, [Message("user", "x")] * MAX_CHAT_MESSAGES) is not None
    assert tokenizer.prompt_token_ids(None, [Message("user", "x")] * (MAX_CHAT_MESSAGES + 1)) \
        is None
    assert rendered == [MAX_CHAT_MESSAGES]
