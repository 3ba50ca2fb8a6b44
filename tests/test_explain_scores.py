"""``lig explain`` shows a scorer pipeline's scores per pod, in text and in --json."""

from __future__ import annotations

import json
from pathlib import Path

from lig.cli import main

# The default token_load rates the recent tokens (the unreported ones only with recent: false).
PODS = [{"name": "hot", "address": "10.0.0.1:8000", "unreported_tokens": 24_000,
         "recent_tokens": 24_000},
        {"name": "cold", "address": "10.0.0.2:8000", "waiting": 2},
        {"name": "warm", "address": "10.0.0.3:8000", "kv_cache_usage": 0.5}]
REQUEST = {"model": "llama", "prompt_tokens": 4000, "prefix_blocks": 31,
           "prefix_hits": {"hot": 31, "warm": 10}}


def files(tmp_path: Path) -> list[str]:
    (tmp_path / "pods.json").write_text(json.dumps(PODS))
    (tmp_path / "request.json").write_text(json.dumps(REQUEST))
    return ["explain", "--pods", str(tmp_path / "pods.json"), "--request",
            str(tmp_path / "request.json"), "--policy", "prefix-aware", "--seed", "1"]


def test_json_lists_every_pods_total_and_scorer_scores(tmp_path, capsys) -> None:
    assert main([*files(tmp_path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    scores = {entry["pod"]: entry for entry in result["scores"]}
    assert set(scores) == {"hot", "cold", "warm"}
    assert scores["hot"]["scores"]["prefix_affinity"] == 1.0
    assert abs(scores["warm"]["scores"]["prefix_affinity"] - 10 / 31) < 1e-9
    assert scores["hot"]["scores"]["token_load"] < 0.2
    weighted = (2 * 1.0 + scores["hot"]["scores"]["token_load"] + 1.0 + 1.0 + 0.0)
    assert abs(scores["hot"]["total"] - weighted) < 1e-9
    assert result["pick"] == "hot"
    assert [step["step"] for step in result["steps"]] == [
        "sheddable_gate", "weighted scores", "least_work pick"]


def test_text_shows_a_score_table_best_first(tmp_path, capsys) -> None:
    assert main(files(tmp_path)) == 0
    out = capsys.readouterr().out
    table = out[out.index("scores (weighted total"):].splitlines()[1:4]
    assert [line.split()[0] for line in table] == ["hot", "warm", "cold"]
    assert "prefix_affinity=1.000" in table[0] and "token_load=0.146" in table[0]
    assert out.rstrip().endswith("pick: hot (10.0.0.1:8000)")


def test_the_filter_tree_shows_no_scores(tmp_path, capsys) -> None:
    args = files(tmp_path)
    args[args.index("prefix-aware")] = "filter-tree"
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["scores"] == []


def test_the_prefix_example_shows_the_load_margin(capsys) -> None:
    examples = Path(__file__).resolve().parents[1] / "examples" / "explain"
    assert main(["explain", "--pods", str(examples / "prefix-pods.json"), "--request",
                 str(examples / "prefix-request.json"), "--policy", "prefix-aware",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    scores = {entry["pod"]: entry["scores"] for entry in result["scores"]}
    assert scores["vllm-3"]["prefix_affinity"] == 0.0  # whole prefix, but 12 waiting > margin
    assert scores["vllm-1"]["prefix_affinity"] == 1.0
    assert result["pick"] == "vllm-1"
