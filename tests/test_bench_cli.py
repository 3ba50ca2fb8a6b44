"""``lig bench`` through ``lig.cli.main``: outputs of a small sweep, flag errors, doc blocks."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from lig.cli import main
from scheduling_bench.default_sweep import POLICIES, RATES, points, replace_blocks
from scheduling_bench.results import RunMetrics


def test_small_sweep_writes_results_table_and_plot(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    code = main([
        "bench", "--workload", "mixed-criticality",
        "--policies", "round-robin,filter-tree,filter-tree+raw",
        "--rates", "40,450", "--duration", "2", "--pickers", "2", "--jobs", "1",
        "--out", str(out),
    ])
    assert code == 0
    results = msgspec.json.decode((out / "results.json").read_bytes(), type=list[RunMetrics])
    assert [(r.rate, r.policy) for r in results] == [
        (40, "round-robin"), (40, "filter-tree"), (40, "filter-tree+raw"),
        (450, "round-robin"), (450, "filter-tree"), (450, "filter-tree+raw"),
    ]
    assert all(r.pods == 8 and r.pickers == 2 and r.workload == "mixed-criticality"
               for r in results)
    table = (out / "results.md").read_text()
    assert table in capsys.readouterr().out
    assert "| 450 | filter-tree |" in table and "Sheddable shed" in table
    png = (out / "mixed-criticality.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) < 300_000


def test_workload_flags_override_the_preset(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = main([
        "bench", "--workload", "chat", "--adapters", "6", "--max-loras", "2",
        "--policies", "filter-tree", "--rates", "30", "--duration", "2", "--jobs", "1",
        "--no-plots", "--out", str(out),
    ])
    assert code == 0
    (result,) = msgspec.json.decode((out / "results.json").read_bytes(), type=list[RunMetrics])
    assert result.adapter_loads > 0
    assert not (out / "chat.png").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--policies", "fastest"], "unknown policy 'fastest'"),
        (["--policies", "fastest+raw"], "unknown policy 'fastest'"),
        (["--rates", "10,fast"], "--rates: expected comma-separated numbers"),
        (["--rates", "0"], "--rates: expected positive numbers"),
        (["--workload", "trace"], "--workload trace needs --trace PATH"),
        (["--trace", "/nonexistent/trace.csv", "--workload", "trace"], "No such file"),
        (["--sheddable-fraction", "1.5"], "add up to at most 1"),
        (["--sweep", "default"], "--sweep default replays a trace"),
        (["--profile", "no-such-gpu"], "unknown profile"),
        (["--decision-delay", "-0.001"], "--decision-delay must be >= 0"),
        (["--policies", "fastest+oracle"], "unknown policy 'fastest'"),
    ],
)
def test_bad_flags_exit_2_with_one_line(tmp_path: Path, capsys, flags, message) -> None:
    code = main(["bench", *flags, "--duration", "1", "--out", str(tmp_path / "o"), "--jobs", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_replace_blocks_rewrites_only_the_generated_parts() -> None:
    text = (
        "# Title\nprose before\n<!-- bench:chat -->\nold table\n<!-- /bench:chat -->\n"
        "prose between\n<!-- bench:setup -->\nold setup\n<!-- /bench:setup -->\nend\n"
    )
    new = replace_blocks(text, {"chat": "new table\n", "setup": "new setup\n"})
    assert new == text.replace("old table", "new table").replace("old setup", "new setup")
    assert replace_blocks(new, {"chat": "new table\n", "setup": "new setup\n"}) == new
    with pytest.raises(ValueError, match="<!-- bench:trace -->"):
        replace_blocks(text, {"chat": "x\n", "trace": "y\n"})


def test_the_checked_in_document_has_every_generated_block() -> None:
    doc = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
    blocks = {name: "" for name in [*RATES, "setup", "freshness", "replicas", "prefix-fit",
                                          "prefix-sources", "kv-event-delay"]}
    replace_blocks(doc.read_text(), blocks)  # raises when a block is missing


def test_default_sweep_covers_every_workload_policy_and_rate() -> None:
    sweep = points("conv.csv")
    assert {p.workload.name for p in sweep} == set(RATES)
    assert all(p.pods == 8 for p in sweep)
    assert {p.workload.trace for p in sweep if p.workload.name == "trace"} == {"conv.csv"}
    assert len(sweep) == sum(len(rates) for rates in RATES.values()) * len(POLICIES)
    # Our default (with the pickers' load estimate) beside the upstream-faithful tree.
    assert {(p.label, p.load_estimate) for p in sweep
            if p.policy.name == "filter-tree" and p.alias is None} == {
        ("filter-tree", True), ("filter-tree+raw", False)}
    assert {p.label for p in sweep if p.oracle} == {"default+oracle"}
