"""``lig picker --tokenizer POOL=SPEC`` (env LIG_TOKENIZER): per-pool tokenizers for precise
prefix routing; a bad one stops the picker at startup with exit code 2 and one line."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scheduling.prompt_tokenizers import HFTokenizer, SimTokenizer
from services.picker.core import load_tokenizers
from services.picker.main import configure, settings_from
from shared.errors import ConfigError
from tests.support.hf_tokenizer import write_tokenizer


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(argv)


@pytest.fixture(autouse=True)
def _no_tokenizer_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIG_TOKENIZER", raising=False)
    monkeypatch.delenv("LIG_POOL", raising=False)


def test_flags_load_one_tokenizer_per_pool(tmp_path: Path) -> None:
    path = write_tokenizer(tmp_path)
    settings = settings_from(parse("--tokenizer", "sim=builtin:lig-sim",
                                   "--tokenizer", f"real={path.parent}"))
    loaded = load_tokenizers(settings)
    assert isinstance(loaded["sim"], SimTokenizer)
    assert isinstance(loaded["real"], HFTokenizer)
    assert set(loaded) == {"sim", "real"}


def test_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIG_TOKENIZER", "a=builtin:lig-sim,b=builtin:lig-sim")
    assert settings_from(parse()).tokenizer_specs == {"a": "builtin:lig-sim",
                                                      "b": "builtin:lig-sim"}


@pytest.mark.parametrize("argv, words", [
    (("--tokenizer", "p=/nonexistent/tokenizer.json"), ("pool p", "no such file")),
    (("--tokenizer", "p"), ("is not POOL=PATH",)),
    (("--tokenizer", "p=builtin:other"), ("unknown built-in tokenizer",)),
    (("--tokenizer", "p=builtin:lig-sim", "--tokenizer", "p=builtin:lig-sim"),
     ("two tokenizers",)),
    (("--pool", "a", "--tokenizer", "b=builtin:lig-sim"), ("names pool b",)),
])
def test_bad_values_are_one_line_config_errors(argv: tuple[str, ...],
                                               words: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as error:
        settings_from(parse(*argv))
    message = str(error.value)
    assert "--tokenizer" in message and "\n" not in message
    for word in words:
        assert word in message


def test_lig_picker_exits_2_on_a_bad_tokenizer_file(tmp_path: Path) -> None:
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{}")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop("LIG_TOKENIZER", None)
    result = subprocess.run(
        [sys.executable, "-m", "lig.cli", "picker", "--tokenizer", f"pool-a={broken}",
         "--grpc-port", "0", "--health-port", "0", "--metrics-port", "0"],
        capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pool pool-a" in lines[0] and str(broken) in lines[0]
