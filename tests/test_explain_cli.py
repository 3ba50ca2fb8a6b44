"""``lig explain`` end to end through ``lig.cli.main`` with files on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lig.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "explain"


def write(tmp_path: Path, name: str, content: object) -> str:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def explain_json(capsys, *args: str) -> dict:
    assert main(["explain", *args, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one JSON object on one line
    return json.loads(out)


def test_examples_text_output(capsys) -> None:
    pods, req = str(EXAMPLES / "pods.json"), str(EXAMPLES / "request.json")
    assert main(["explain", "--pods", pods, "--request", req, "--seed", "1",
                 "--policy", "filter-tree"]) == 0
    out = capsys.readouterr().out
    assert "affinity LoRA" in out and "3 in -> 2 kept [vllm-1, vllm-2]" in out
    assert out.rstrip().endswith("pick: vllm-1 (10.0.0.11:8000)")


def test_examples_json_output(capsys) -> None:
    pods, req = str(EXAMPLES / "pods.json"), str(EXAMPLES / "request.json")
    result = explain_json(capsys, "--pods", pods, "--request", req, "--policy", "filter-tree")
    assert result["candidates"] == ["vllm-1"]
    assert (result["pick"], result["shed"], result["policy"]) == ("vllm-1", False, "filter-tree")
    assert [s["step"] for s in result["steps"]] == [
        "critical request",
        "low queueing filter",
        "affinity LoRA",
        "least queuing",
        "least KV cache percent",
        "random pick",
    ]
    assert result["steps"][1] == {
        "step": "low queueing filter",
        "entered": ["vllm-0", "vllm-1", "vllm-2", "vllm-3"],
        "kept": ["vllm-0", "vllm-1", "vllm-2"],
        "branch": "on_success",
    }


def test_request_defaults_and_shedding(tmp_path, capsys) -> None:
    pods = write(tmp_path, "pods.json", [{"name": "a", "waiting": 9, "kv_cache_usage": 0.95}])
    standard = write(tmp_path, "standard.json", {"model": "llama"})
    result = explain_json(capsys, "--pods", pods, "--request", standard)
    assert result["request"] == {
        "model": "llama",
        "target_model": "llama",
        "criticality": "Standard",
    }
    assert (result["pick"], result["shed"]) == ("a", False)

    sheddable = write(tmp_path, "shed.json", {"model": "llama", "criticality": "Sheddable"})
    result = explain_json(capsys, "--pods", pods, "--request", sheddable)
    assert (result["candidates"], result["pick"], result["shed"]) == ([], None, True)
    assert main(["explain", "--pods", pods, "--request", sheddable]) == 0
    assert "shed" in capsys.readouterr().out


def test_empty_pod_list(tmp_path, capsys) -> None:
    pods = write(tmp_path, "pods.json", [])
    req = write(tmp_path, "req.json", {"model": "m"})
    result = explain_json(capsys, "--pods", pods, "--request", req)
    assert (result["candidates"], result["pick"], result["shed"], result["steps"]) == (
        [],
        None,
        False,
        [],
    )


def test_policy_param_and_seed(tmp_path, capsys) -> None:
    pods = write(tmp_path, "pods.json", [{"name": f"p{i}"} for i in range(6)])
    req = write(tmp_path, "req.json", {"model": "m"})
    args = ["--pods", pods, "--request", req]

    rr = explain_json(capsys, *args, "--policy", "round-robin")
    assert (rr["policy"], rr["pick"]) == ("round-robin", "p0")

    # queueing_threshold_lora=0: no pod is under the threshold, so that step fails
    tree = explain_json(capsys, *args, "--policy", "filter-tree",
                        "--param", "queueing_threshold_lora=0")
    assert tree["steps"][1]["kept"] == [] and tree["steps"][1]["branch"] == "on_failure"

    picks = {explain_json(capsys, *args, "--seed", "4")["pick"] for _ in range(3)}
    assert len(picks) == 1
    other = {explain_json(capsys, *args, "--seed", str(seed))["pick"] for seed in range(12)}
    assert len(other) > 1


@pytest.mark.parametrize(
    ("pods", "req", "fragments"),
    [
        ([{"name": "a", "waiting": "3"}], {"model": "m"}, ["pods.json", "$[0].waiting", "int"]),
        ([{"name": "a"}, {"address": "x"}], {"model": "m"}, ["pods.json", "name", "$[1]"]),
        ([{"name": "a", "kv_cache": 0.5}], {"model": "m"}, ["pods.json", "kv_cache"]),
        ([{"name": "a", "kv_cache_usage": 80}], {"model": "m"}, ["$[0].kv_cache_usage"]),
        ([{"name": "a"}, {"name": "a"}], {"model": "m"}, ["$[1].name", "duplicate"]),
        ({"name": "a"}, {"model": "m"}, ["pods.json", "array"]),
        ("[{", {"model": "m"}, ["pods.json", "JSON"]),
        ([], {"target_model": "m"}, ["request.json", "model"]),
        ([], {"model": "m", "criticality": "Urgent"}, ["request.json", "$.criticality"]),
        ([], {"model": 3}, ["request.json", "$.model", "str"]),
    ],
)
def test_bad_input_files_exit_2_with_one_line(tmp_path, capsys, pods, req, fragments) -> None:
    args = [
        "explain",
        "--pods",
        write(tmp_path, "pods.json", pods),
        "--request",
        write(tmp_path, "request.json", req),
    ]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    for fragment in fragments:
        assert fragment in captured.err


def test_missing_file_exit_2(tmp_path, capsys) -> None:
    req = write(tmp_path, "req.json", {"model": "m"})
    missing = str(tmp_path / "nowhere.json")
    assert main(["explain", "--pods", missing, "--request", req]) == 2
    err = capsys.readouterr().err
    assert missing in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("param", "fragment"),
    [
        ("queueing_threshold_lora=lots", "'queueing_threshold_lora'"),
        ("no_such_threshold=1", "'no_such_threshold'"),
        ("queueing_threshold_lora", "KEY=VALUE"),
    ],
)
def test_bad_param_exit_2(tmp_path, capsys, param, fragment) -> None:
    pods = write(tmp_path, "pods.json", [{"name": "a"}])
    req = write(tmp_path, "req.json", {"model": "m"})
    assert main(["explain", "--pods", pods, "--request", req, "--param", param]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1


def test_unknown_policy_is_a_usage_error(tmp_path, capsys) -> None:
    pods = write(tmp_path, "pods.json", [{"name": "a"}])
    req = write(tmp_path, "req.json", {"model": "m"})
    with pytest.raises(SystemExit) as info:
        main(["explain", "--pods", pods, "--request", req, "--policy", "fastest"])
    assert info.value.code == 2
    assert "fastest" in capsys.readouterr().err


def test_pods_become_the_views_the_pickers_pod_table_builds(tmp_path: Path, capsys) -> None:
    """Views come from the picker's PodTable: a pod that reports no LoRA capacity yet (vLLM
    before its first step) is offered the pool's, and in-flight requests are counted."""
    pods = write(tmp_path, "pods.json", [
        {"name": "busy", "address": "10.0.0.1:8000", "waiting": 3, "running_adapters": ["a"],
         "max_lora": 1},
        {"name": "fresh", "address": "10.0.0.2:8000", "in_flight": 2},
    ])
    request = write(tmp_path, "request.json", {"model": "b"})
    result = explain_json(capsys, "--pods", pods, "--request", request, "--policy",
                          "filter-tree")
    # "busy" has its one slot taken by adapter a: only "fresh" (assumed 1 slot) can load b.
    assert result["pick"] == "fresh"
    from lig.explain import PodEntry, picker_views

    views = picker_views([PodEntry("busy", max_lora=4), PodEntry("fresh", in_flight=2)])
    assert [(v.name, v.max_lora, v.in_flight) for v in views] == [("busy", 4, 0),
                                                                  ("fresh", 4, 2)]
