"""Small real Hugging Face tokenizers, trained here (no download): a ``tokenizer.json`` written by
the ``tokenizers`` package, with a ``tokenizer_config.json`` carrying a ChatML chat template as
Qwen's and others' (and a BOS the post-processor adds, as Llama's)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from simulator.tokenizer import WORDS

CHATML_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def _corpus() -> list[str]:
    lines = []
    for start in range(0, len(WORDS), 7):
        words = WORDS[start:start + 12]
        lines.append(" ".join(words) + ", " + " ".join(reversed(words)) + ". 12345 6789!")
        lines.append("\n".join(words) + "  café naïve 日本 <b>x</b>")
    return lines * 3


def train_tokenizer(kind: str = "byte_level", vocab_size: int = 2000) -> Tokenizer:
    """A BPE tokenizer trained on the simulator's words: ``byte_level`` (GPT-2 / Llama 3 / Qwen
    style pre-tokenizer) or ``metaspace_first`` (SentencePiece style, a space added only at the
    start of the text), both adding ``<s>`` before every sequence."""
    tokenizer = Tokenizer(models.BPE())
    if kind == "byte_level":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    elif kind == "metaspace_first":
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
        alphabet = []
    else:
        raise ValueError(kind)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(_corpus(), trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return tokenizer


def write_tokenizer(directory: Path, kind: str = "byte_level",
                    template: str | None = CHATML_TEMPLATE) -> Path:
    """Write ``tokenizer.json`` (and ``tokenizer_config.json`` with ``template`` unless None)
    into ``directory``; returns the tokenizer.json path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    train_tokenizer(kind).save(str(path))
    config: dict[str, object] = {"bos_token": "<s>", "eos_token": "<|im_end|>"}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path
