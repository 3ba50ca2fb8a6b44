"""Pools' prompt tokenizers (scheduling/prompt_tokenizers.py): the token ids the engine sees.

The simulator's tokenizer is checked against what ``lig sim`` itself tokenizes for the same body;
Hugging Face tokenizers (small real ones trained here) against the ``tokenizers`` package's own
``encode`` of the rendered prompt, cut and cached or not.
"""

from __future__ import annotations

import array
import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduling.prompt import ContentPart, Message
from scheduling.prompt_tokenizers import (
    BUILTIN_SIM,
    HFTokenizer,
    IdsCache,
    SimTokenizer,
    TokenizerLoadError,
    load_pool_tokenizers,
    load_prompt_tokenizer,
    parse_pool_specs,
)
from simulator.openai_api import parse_completion
from tests.support.hf_tokenizer import CHATML_TEMPLATE, write_tokenizer

CHAT = [Message("system", "You are a helpful assistant. " * 40),
        Message("user", "What is the number 12345, and why?"),
        Message("assistant", "the water is old"),
        Message("user", [ContentPart("text", "first part"), ContentPart("text", "second")])]


def _body(messages: list[Message]) -> dict[str, object]:
    return {"model": "m", "messages": msgspec.to_builtins(messages)}


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {kind: write_tokenizer(root / kind, kind).parent
            for kind in ("byte_level", "metaspace_first")}


@pytest.fixture(scope="module")
def byte_level(tokenizer_dirs: dict[str, Path]) -> HFTokenizer:
    loaded = load_prompt_tokenizer(str(tokenizer_dirs["byte_level"]))
    assert isinstance(loaded, HFTokenizer)
    return loaded


# -- builtin:lig-sim --------------------------------------------------------------------------

def test_sim_chat_ids_are_the_simulators() -> None:
    tokenizer = SimTokenizer()
    body = _body(CHAT)
    expected = parse_completion(json.dumps(body).encode(), chat=True, default_model="m").prompt
    assert list(tokenizer.prompt_token_ids(None, CHAT) or ()) == list(expected)


def test_sim_completion_text_and_token_ids() -> None:
    tokenizer = SimTokenizer()
    text = "Once upon a time, 42 tokens."
    expected = parse_completion(json.dumps({"prompt": text}).encode(), chat=False,
                                default_model="m").prompt
    assert list(tokenizer.prompt_token_ids(text, None) or ()) == list(expected)
    assert list(tokenizer.prompt_token_ids([text, "other"], None) or ()) == list(expected)
    assert list(tokenizer.prompt_token_ids([5, 6, 7], None) or ()) == [5, 6, 7]
    assert list(tokenizer.prompt_token_ids([[5, 6], [7]], None) or ()) == [5, 6]


def test_sim_shared_prefix_is_tokenized_once() -> None:
    tokenizer = SimTokenizer()
    first = [*CHAT[:1], Message("user", "one question")]
    second = [*CHAT[:1], Message("user", "another question")]
    tokenizer.prompt_token_ids(None, first)
    misses = tokenizer.cache.misses
    ids = tokenizer.prompt_token_ids(None, second)
    assert tokenizer.cache.misses == misses + 1  # only the new user message
    expected = parse_completion(json.dumps(_body(second)).encode(), chat=True,
                                default_model="m").prompt
    assert list(ids or ()) == list(expected)


@pytest.mark.parametrize("prompt, messages", [
    (None, [Message("user", [ContentPart("image_url", None)])]),  # multimodal: not exact
    (None, []),
    (None, None),
    ([], None),
    ([-1, 2], None),  # not token ids
    ([1, "a"], None),
    ([2**32], None),
])
def test_untokenizable_requests_give_none(prompt: object, messages: object) -> None:
    tokenizer = SimTokenizer()
    assert tokenizer.prompt_token_ids(prompt, messages) is None
    assert tokenizer.refused == 1


def test_sim_turns_concatenate() -> None:
    """What the per-message cache relies on: the chat's ids are its turns' ids end to end."""
    import scheduling.lig_sim_tokenizer as sim
    turns = [("user", "ends with letters"), ("assistant", "123"), ("user", "sym!"),
             ("system", "")]
    whole = sim.encode(sim.render_chat(turns))
    pieces = [i for role, text in turns for i in sim.encode(sim.render_turn(role, text))]
    assert list(whole) == pieces + list(sim.encode(sim.ASSISTANT_OPENING))


# -- Hugging Face tokenizer.json ------------------------------------------------------------

def _rendered(tokenizer: HFTokenizer, messages: list[Message]) -> str:
    assert tokenizer.template is not None
    turns = [{"role": m.role, "content": m.content if isinstance(m.content, str) else
              "\n".join(part.text or "" for part in m.content or [])} for m in messages]
    return tokenizer.template.render(turns)


def test_hf_chat_ids_are_the_tokenizers(byte_level: HFTokenizer) -> None:
    assert byte_level.cut
    rendered = _rendered(byte_level, CHAT)
    assert rendered.startswith("<s><|im_start|>system\nYou are")
    assert rendered.endswith("<|im_start|>assistant\n")
    expected = byte_level._tokenizer.encode(rendered, add_special_tokens=False).ids
    assert list(byte_level.prompt_token_ids(None, CHAT) or ()) == expected
    # again, from the cache
    assert list(byte_level.prompt_token_ids(None, CHAT) or ()) == expected


def test_hf_completion_adds_the_post_processors_tokens(byte_level: HFTokenizer) -> None:
    text = "the water <|im_end|> is old  "
    expected = byte_level._tokenizer.encode(text, add_special_tokens=True).ids
    assert expected[0] == byte_level._tokenizer.token_to_id("<s>")
    assert list(byte_level.prompt_token_ids(text, None) or ()) == expected


_texts = st.lists(st.sampled_from([*"ab ç\n\t1.!<>|", "<|im_start|>", "<|im_end|>", "<s>",
                                   "water", " the"]), max_size=40).map("".join)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(system=_texts, user=_texts, completion=_texts)
def test_hf_cut_and_cached_equals_whole(byte_level: HFTokenizer, system: str, user: str,
                                        completion: str) -> None:
    messages = [Message("system", system), Message("user", user)]
    rendered = _rendered(byte_level, messages)
    whole = byte_level._tokenizer.encode(rendered, add_special_tokens=False).ids
    assert list(byte_level.prompt_token_ids(None, messages) or ()) == whole
    whole = byte_level._tokenizer.encode(completion, add_special_tokens=True).ids
    assert list(byte_level.prompt_token_ids(completion, None) or ()) == whole


def test_hf_position_dependent_tokenizer_is_used_whole(tokenizer_dirs: dict[str, Path]) -> None:
    tokenizer = load_prompt_tokenizer(str(tokenizer_dirs["metaspace_first"]))
    assert isinstance(tokenizer, HFTokenizer)
    assert not tokenizer.cut  # the load-time check found the cut ids wrong
    rendered = _rendered(tokenizer, CHAT)
    expected = tokenizer._tokenizer.encode(rendered, add_special_tokens=False).ids
    assert list(tokenizer.prompt_token_ids(None, CHAT) or ()) == expected


def test_hf_without_template_refuses_chat_only(tmp_path: Path) -> None:
    path = write_tokenizer(tmp_path, template=None)
    tokenizer = load_prompt_tokenizer(str(path))
    assert tokenizer.prompt_token_ids(None, CHAT) is None
    assert tokenizer.prompt_token_ids("hello", None) is not None


def test_template_file_and_named_templates(tmp_path: Path) -> None:
    path = write_tokenizer(tmp_path / "jinja", template=None)
    (path.parent / "chat_template.jinja").write_text("{{ messages[0]['content'] }}|",
                                                     encoding="utf-8")
    tokenizer = load_prompt_tokenizer(str(path))
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.template is not None
    assert tokenizer.template.render([{"role": "user", "content": "x"}]) == "x|"

    path = write_tokenizer(tmp_path / "named", template=None)
    config = json.loads((path.parent / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"},
                               {"name": "default", "template": CHATML_TEMPLATE}]
    (path.parent / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_prompt_tokenizer(str(path))
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.template is not None
    assert tokenizer.template.source == CHATML_TEMPLATE


def test_openai_content_format_templates_get_parts(tmp_path: Path) -> None:
    """A template looping over content parts gets them as dicts, as vLLM detects and does
    (and trim_blocks drops the newline after a block tag, as in transformers)."""
    path = write_tokenizer(tmp_path, template=(
        "{% for message in messages %}{{ message['role'] }}:"
        "{% for part in message['content'] %}[{{ part['text'] }}]{% endfor %}\n{% endfor %}"))
    tokenizer = load_prompt_tokenizer(str(path))
    assert isinstance(tokenizer, HFTokenizer)
    messages = [Message("user", [ContentPart("text", "a"), ContentPart("text", "b")])]
    expected = tokenizer._tokenizer.encode("user:[a][b]", add_special_tokens=False).ids
    assert list(tokenizer.prompt_token_ids(None, messages) or ()) == expected


def test_template_that_refuses_gives_none(tmp_path: Path) -> None:
    path = write_tokenizer(tmp_path, template=(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{{ messages[0]['content'] }}"))
    tokenizer = load_prompt_tokenizer(str(path))
    assert tokenizer.prompt_token_ids(None, [Message("system", "x")]) is None
    assert tokenizer.prompt_token_ids(None, [Message("user", "x")]) is not None


# -- loading and configuration ---------------------------------------------------------------

def test_load_errors_name_the_file_and_reason(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="no such file"):
        load_prompt_tokenizer(str(tmp_path / "missing.json"))
    with pytest.raises(TokenizerLoadError, match="unknown built-in tokenizer"):
        load_prompt_tokenizer("builtin:gpt")
    bad = tmp_path / "bad" / "tokenizer.json"
    bad.parent.mkdir()
    bad.write_text("{not json")
    with pytest.raises(TokenizerLoadError, match=r"not a tokenizers tokenizer\.json"):
        load_prompt_tokenizer(str(bad))
    path = write_tokenizer(tmp_path / "config", template=None)
    (path.parent / "tokenizer_config.json").write_text("[1]")
    with pytest.raises(TokenizerLoadError, match="not a JSON object"):
        load_prompt_tokenizer(str(path))
    path = write_tokenizer(tmp_path / "syntax", template="{% for %}")
    with pytest.raises(TokenizerLoadError, match="does not compile"):
        load_prompt_tokenizer(str(path))
    with pytest.raises(TokenizerLoadError, match=r"pool p2: .*no such file"):
        load_pool_tokenizers({"p1": BUILTIN_SIM, "p2": str(tmp_path / "nothing")})


def test_parse_pool_specs() -> None:
    assert parse_pool_specs(["a=builtin:lig-sim", " b = /x/tokenizer.json "]) == {
        "a": BUILTIN_SIM, "b": "/x/tokenizer.json"}
    for bad in (["a"], ["=x"], ["a="]):
        with pytest.raises(ValueError, match="is not POOL=PATH"):
            parse_pool_specs(bad)
    with pytest.raises(ValueError, match="two tokenizers"):
        parse_pool_specs(["a=x", "a=y"])


def test_ids_cache_is_bounded() -> None:
    cache = IdsCache(max_tokens=10, max_entries=3)
    for key in range(5):
        cache.put(key, array.array("I", [key] * 3))
    assert len(cache) == 3 and cache.tokens == 9
    assert cache.get(0) is None and cache.get(4) is not None
    cache.put(99, array.array("I", range(11)))  # larger than the cache: not kept
    assert cache.get(99) is None
    cache.put(5, array.array("I", range(4)))  # 3 + 3 + 4 > 10: the oldest goes
    assert cache.tokens <= 10 and cache.get(4) is not None


def test_hf_tokens_that_swallow_whitespace() -> None:
    """An added token with lstrip/rstrip takes the whitespace around it, cut or whole."""
    from tokenizers import AddedToken

    from scheduling.chat_template import ChatTemplate
    from tests.support.hf_tokenizer import train_tokenizer
    trained = train_tokenizer()
    trained.add_special_tokens([AddedToken("<tool>", lstrip=True, rstrip=True, special=True)])
    tokenizer = HFTokenizer(trained, ChatTemplate(CHATML_TEMPLATE, {"bos_token": "<s>"}))
    assert tokenizer.cut
    for text in ("a  <tool>  b", "<tool> x", "x\n<tool>\n", "  <tool><tool>  y", "<tool>"):
        assert list(tokenizer.prompt_token_ids(text, None) or ()) == trained.encode(text).ids


# -- lig sim --tokenizer: the simulated engine tokenizes as the picker does ------------------

def test_sim_with_a_tokenizer_json_tokenizes_prompts_with_it(byte_level: HFTokenizer) -> None:
    from simulator.openai_api import ApiError
    body = json.dumps(_body(CHAT)).encode()
    call = parse_completion(body, chat=True, default_model="m", prompt_tokenizer=byte_level)
    expected = byte_level._tokenizer.encode(_rendered(byte_level, CHAT),
                                            add_special_tokens=False).ids
    assert list(call.prompt) == expected
    call = parse_completion(b'{"prompt": "the water"}', chat=False, default_model="m",
                            prompt_tokenizer=byte_level)
    assert list(call.prompt) == byte_level._tokenizer.encode("the water").ids
    image = {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                         "image_url": {"url": "x"}}]}]}
    with pytest.raises(ApiError):  # the simulator refuses non-text parts anyway
        parse_completion(json.dumps(image).encode(), chat=True, default_model="m",
                         prompt_tokenizer=byte_level)


def test_template_variables_and_tags_as_transformers_renders_them() -> None:
    """``tools`` is none (not undefined), ``{% generation %}`` renders its body, ``tojson``
    keeps non-ASCII text, special tokens are variables."""
    from scheduling.chat_template import ChatTemplate
    template = ChatTemplate(
        "{% if tools is not none %}TOOLS{% endif %}{{ bos_token }}"
        "{% for m in messages %}{% generation %}{{ m['content'] | tojson }}{% endgeneration %}"
        "{% endfor %}{{ additional_special_tokens | length }}",
        {"bos_token": "<s>", "additional_special_tokens": ["<a>", "<b>"]})
    assert template.render([{"role": "user", "content": "café"}]) == '<s>"café"2'


# -- long text in chunks ----------------------------------------------------------------------

_LONG = " ".join(["Once", "upon", "a", "time,", "12345", "caf\u00e9", "there", "was", "it's",
                  "(really)", "a", "fox."] * 60)  # ~3,000 characters: three chunks and a bit


@pytest.mark.parametrize("kind", ["sim", "hf"])
def test_long_shared_prefix_is_tokenized_once(kind: str, byte_level: HFTokenizer) -> None:
    tokenizer = SimTokenizer() if kind == "sim" else load_prompt_tokenizer(byte_level.name)
    assert isinstance(tokenizer, SimTokenizer | HFTokenizer)

    def whole(text: str) -> list[int]:
        if isinstance(tokenizer, SimTokenizer):
            import scheduling.lig_sim_tokenizer as sim
            return list(sim.encode(text))
        return tokenizer._tokenizer.encode(text).ids

    first = _LONG + " first question?"
    assert list(tokenizer.prompt_token_ids(first, None) or ()) == whole(first)
    hits, misses = tokenizer.cache.hits, tokenizer.cache.misses
    second = _LONG + " another question?"
    assert list(tokenizer.prompt_token_ids(second, None) or ()) == whole(second)
    assert tokenizer.cache.hits >= hits + 2  # the shared chunks
    assert tokenizer.cache.misses == misses + 1  # only the last chunk is new


_words = st.sampled_from(["a", "the", "water", "12345", "3.14", "caf\u00e9", "it's", "(x)",
                          "!", "\n", "\t", "", "<|im_end|>", "<s>", "\u65e5\u672c", "Word"])


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(_words, min_size=300, max_size=900))
def test_hf_long_text_in_chunks_equals_whole(byte_level: HFTokenizer, words: list[str]) -> None:
    text = " ".join(words)
    assert list(byte_level.prompt_token_ids(text, None) or ()) == \
        byte_level._tokenizer.encode(text).ids


def test_returned_ids_are_the_callers_own(byte_level: HFTokenizer) -> None:
    """Changing the ids a tokenizer returned does not change what it returns next time."""
    for tokenizer in (SimTokenizer(), byte_level):
        first = tokenizer.prompt_token_ids("hello there", None)
        assert isinstance(first, array.array)
        expected = list(first)
        first.append(7)
        first[0] = 1
        assert list(tokenizer.prompt_token_ids("hello there", None) or ()) == expected


def test_huge_prompts_are_tokenized_only_as_far_as_looked_up(byte_level: HFTokenizer) -> None:
    """Past max_tokens the rest of a prompt is not tokenized: what is returned is the start of
    the prompt's ids, exactly."""
    import scheduling.lig_sim_tokenizer as sim
    huge = " ".join(["word", "caf\u00e9", "12345,", "water"] * 20_000)  # ~100,000 tokens
    hf = HFTokenizer(byte_level._tokenizer, byte_level.template, max_tokens=1000)
    ids = list(hf.prompt_token_ids(huge, None) or ())
    assert 1000 <= len(ids) < 1500
    assert ids == byte_level._tokenizer.encode(huge).ids[:len(ids)]
    chat = [Message("system", huge), Message("user", "and then?")]
    ids = list(hf.prompt_token_ids(None, chat) or ())
    assert 1000 <= len(ids) < 1500
    whole = byte_level._tokenizer.encode(_rendered(byte_level, chat), add_special_tokens=False)
    assert ids == whole.ids[:len(ids)]
    for turns in ([("system", huge), ("user", "and then?")], [("user", huge)]):
        simulated = SimTokenizer(max_tokens=1000)
        ids = list(simulated.prompt_token_ids(None, [Message(*turn) for turn in turns]) or ())
        assert 1000 <= len(ids) < 1500
        assert ids == list(sim.encode(sim.render_chat(turns)))[:len(ids)]
