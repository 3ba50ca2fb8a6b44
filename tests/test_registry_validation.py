"""Registry input validation and conversion: pure, no NATS.

Every invalid input must be rejected with a problem naming the file, the document and the field.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.registry import files
from services.registry.check import check
from services.registry.files import MAX_FILE_BYTES, FileSnapshot, SourceFile, load, read_files
from services.registry.loader import InvalidRegistry, Problem
from services.registry.overrides import OverrideError, apply_override, read_override
from shared.schemas import DEFAULT_POLICY_NAME, Criticality, Endpoint, TargetModel
from tests.support.registry_yaml import dump, model, pool

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "local" / "pool.yaml"


def problems_of(*files: tuple[str, str]) -> list[Problem]:
    """Load ``(path, text)`` files, which must be invalid; return the problems."""
    snapshot = FileSnapshot(tuple(SourceFile(path, text) for path, text in files))
    with pytest.raises(InvalidRegistry) as caught:
        load(snapshot)
    return list(caught.value.problems)


def with_spec(document: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of ``document`` with ``spec.<path>`` (dots, and [i] for list items) set to value;
    ``value=DELETE`` removes the field."""
    result = copy.deepcopy(document)
    target: Any = result["spec"]
    parts = path.replace("[", ".").replace("]", "").split(".")
    for part in parts[:-1]:
        target = target[int(part)] if part.isdigit() else target[part]
    last: Any = int(parts[-1]) if parts[-1].isdigit() else parts[-1]
    if value is DELETE:
        del target[last]
    else:
        target[last] = value
    return result


DELETE = object()


@pytest.fixture(params=list(files.LOADERS))
def parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with each YAML event parser the registry may use (libyaml, Python)."""
    monkeypatch.setattr(files, "_loader", files.LOADERS[request.param])
    return request.param
POOL = pool()
MODEL = model()

# (case id, documents of one file, expected document number, field, words in the message)
SINGLE_FILE_CASES: list[tuple[str, list[dict[str, Any]], int, str | None, str]] = [
    ("missing kind", [{k: v for k, v in POOL.items() if k != "kind"}], 1, "kind", "missing"),
    ("unknown kind", [POOL, {**MODEL, "kind": "Deployment"}], 2, "kind", "unknown kind"),
    ("missing apiVersion", [{k: v for k, v in POOL.items() if k != "apiVersion"}], 1,
     "apiVersion", "missing"),
    ("unsupported apiVersion", [{**POOL, "apiVersion": "v1"}], 1, "apiVersion", "unsupported"),
    ("missing metadata", [{k: v for k, v in POOL.items() if k != "metadata"}], 1, "metadata",
     "missing"),
    ("missing metadata.name", [{**POOL, "metadata": {"namespace": "x"}}], 1, "metadata.name",
     "missing"),
    ("name not a Kubernetes name", [{**POOL, "metadata": {"name": "Pool_A"}}], 1,
     "metadata.name", "match"),
    ("unknown top-level field", [{**POOL, "sepc": {}}], 1, "sepc", "unknown field"),
    ("missing spec", [{k: v for k, v in POOL.items() if k != "spec"}], 1, "spec", "missing"),
    ("pool missing selector", [with_spec(POOL, "selector", DELETE)], 1, "spec.selector",
     "missing"),
    ("selector value not a string", [with_spec(POOL, "selector", {"version": 2})], 1,
     "spec.selector", "str"),
    ("pool missing targetPortNumber", [with_spec(POOL, "targetPortNumber", DELETE)], 1,
     "spec.targetPortNumber", "missing"),
    ("targetPortNumber zero", [with_spec(POOL, "targetPortNumber", 0)], 1,
     "spec.targetPortNumber", ">= 1"),
    ("targetPortNumber too big", [with_spec(POOL, "targetPortNumber", 70000)], 1,
     "spec.targetPortNumber", "<= 65535"),
    ("targetPortNumber a string", [with_spec(POOL, "targetPortNumber", "8000")], 1,
     "spec.targetPortNumber", "got `str`"),
    ("misspelt spec field", [with_spec(POOL, "targetPort", 8000)], 1, "spec.targetPort",
     "unknown field"),
    ("endpoint without name", [with_spec(POOL, "endpoints[1].name", DELETE)], 1,
     "spec.endpoints[1].name", "missing"),
    ("endpoint host name", [with_spec(POOL, "endpoints[0].address", "vllm.local")], 1,
     "spec.endpoints[0].address", "not an IP address"),
    ("endpoint port out of range", [with_spec(POOL, "endpoints[0].port", 0)], 1,
     "spec.endpoints[0].port", ">= 1"),
    ("endpoint unknown field", [with_spec(POOL, "endpoints[0].ip", "10.0.0.9")], 1,
     "spec.endpoints[0].ip", "unknown field"),
    ("duplicate endpoint name", [with_spec(POOL, "endpoints[1].name", "pod-0")], 1,
     "spec.endpoints[1].name", "duplicate endpoint name"),
    ("duplicate endpoint address", [with_spec(
        with_spec(POOL, "endpoints[1].address", "10.0.0.1"), "endpoints[1].port", 8000)], 1,
     "spec.endpoints[1].address", "duplicate endpoint address 10.0.0.1:8000"),
    ("endpoints not a list", [with_spec(POOL, "endpoints", {"name": "x"})], 1, "spec.endpoints",
     "array"),
    ("metrics path without slash", [with_spec(POOL, "metrics", {"path": "metrics"})], 1,
     "spec.metrics.path", "match"),
    ("rejectUnknownModels not a bool", [with_spec(POOL, "rejectUnknownModels", "maybe")], 1,
     "spec.rejectUnknownModels", "bool"),
    ("unknown policy", [with_spec(POOL, "scheduling", {"policy": "fastest"})], 1,
     "spec.scheduling", "unknown policy 'fastest'"),
    ("unknown policy parameter", [with_spec(POOL, "scheduling", {"params": {"speed": 1}})], 1,
     "spec.scheduling", "unknown parameter 'speed'"),
    ("mistyped policy parameter",
     [with_spec(POOL, "scheduling", {"params": {"queueing_threshold_lora": "many"}})], 1,
     "spec.scheduling", "queueing_threshold_lora"),
    ("model missing modelName", [POOL, with_spec(MODEL, "modelName", DELETE)], 2,
     "spec.modelName", "missing"),
    ("model empty modelName", [POOL, with_spec(MODEL, "modelName", "")], 2, "spec.modelName",
     "length >= 1"),
    ("model missing poolRef", [POOL, with_spec(MODEL, "poolRef", DELETE)], 2, "spec.poolRef",
     "missing"),
    ("poolRef of another kind", [POOL, with_spec(MODEL, "poolRef.kind", "Service")], 2,
     "spec.poolRef.kind", "Invalid enum value 'Service'"),
    ("unknown criticality", [POOL, with_spec(MODEL, "criticality", "Urgent")], 2,
     "spec.criticality", "Invalid enum value 'Urgent'"),
    ("weight zero", [POOL, with_spec(MODEL, "targetModels", [{"name": "a", "weight": 0}])], 2,
     "spec.targetModels[0].weight", ">= 1"),
    ("weight above a million",
     [POOL, with_spec(MODEL, "targetModels", [{"name": "a", "weight": 1_000_001}])], 2,
     "spec.targetModels[0].weight", "<= 1000000"),
    ("weight negative",
     [POOL, with_spec(MODEL, "targetModels", [{"name": "a", "weight": 3}, {"name": "b",
                                                                          "weight": -1}])], 2,
     "spec.targetModels[1].weight", ">= 1"),
    ("weight a fraction", [POOL, with_spec(MODEL, "targetModels", [{"name": "a", "weight": 0.5}])],
     2, "spec.targetModels[0].weight", "got `float`"),
    ("weight a string", [POOL, with_spec(MODEL, "targetModels", [{"name": "a", "weight": "10"}])],
     2, "spec.targetModels[0].weight", "got `str`"),
    ("weight a bool", [POOL, with_spec(MODEL, "targetModels", [{"name": "a", "weight": True}])],
     2, "spec.targetModels[0].weight", "got `bool`"),
    ("target model without name", [POOL, with_spec(MODEL, "targetModels", [{"weight": 1}])], 2,
     "spec.targetModels[0].name", "missing"),
    ("more than 10 target models",
     [POOL, with_spec(MODEL, "targetModels", [{"name": f"t{i}"} for i in range(11)])], 2,
     "spec.targetModels", "length <= 10"),
    ("duplicate target model",
     [POOL, with_spec(MODEL, "targetModels", [{"name": "a"}, {"name": "a", "weight": 2}])], 2,
     "spec.targetModels[1].name", "duplicate target model 'a'"),
    ("model pointing at a missing pool", [POOL, model(pool_name="pool-b")], 2,
     "spec.poolRef.name", "no InferencePool named 'pool-b'"),
    ("model in another namespace than its pool",
     [POOL, {**MODEL, "metadata": {"name": "model-a", "namespace": "other"}}], 2,
     "spec.poolRef.name", "namespace"),
    ("duplicate modelName in one pool",
     [POOL, MODEL, {**model("model-b"), "spec": MODEL["spec"]}], 3, "spec.modelName",
     "'model-a' is already served by pool 'pool-a'"),
    ("duplicate InferenceModel name", [POOL, MODEL, with_spec(MODEL, "modelName", "other")], 3,
     "metadata.name", "duplicate InferenceModel name"),
    ("duplicate pool name", [POOL, pool(endpoints=1)], 2, "metadata.name",
     "duplicate InferencePool name"),
    ("duplicate pool name across namespaces",
     [POOL, {**POOL, "metadata": {"name": "pool-a", "namespace": "other"}}], 2, "metadata.name",
     "duplicate InferencePool name"),
    ("key that is not a string", [{**POOL, 1: "x"}], 1, None, "as a mapping key"),
    ("selector key that is not a string", [with_spec(POOL, "selector", {1: "x"})], 1,
     "spec.selector", "as a mapping key"),
    ("document is a list", [POOL, [1, 2]], 2, None, "expected a mapping"),  # type: ignore[list-item]
    ("document is a string", [POOL, "InferencePool"], 2, None, "got str"),  # type: ignore[list-item]
]


@pytest.mark.parametrize(
    ("documents", "document", "field", "words"),
    [case[1:] for case in SINGLE_FILE_CASES],
    ids=[case[0] for case in SINGLE_FILE_CASES],
)
def test_invalid_document_is_rejected_naming_file_document_and_field(
    documents: list[dict[str, Any]], document: int, field: str | None, words: str
) -> None:
    problems = problems_of(("inputs/pool.yaml", dump(*documents)))
    assert len(problems) == 1, problems
    problem = problems[0]
    assert (problem.source, problem.document, problem.field) == ("inputs/pool.yaml", document,
                                                                 field)
    assert words in problem.message
    assert problem.line is not None
    assert str(problem).startswith(f"inputs/pool.yaml:{problem.line}: document {document}: ")


# (case id, raw YAML text, expected document number, text of the reported line, field, words)
RAW_TEXT_CASES = [
    ("YAML syntax error", dump(POOL) + "---\nkind: [InferenceModel\nspec: {}\n", 2, "spec: {}",
     None, "expected ',' or ']'"),
    ("tab indentation", "kind: x\n\tspec: 1\n", 1, "\tspec: 1", None, "invalid YAML"),
    ("duplicate key", dump(POOL).replace("targetPortNumber: 8000",
                                         "targetPortNumber: 8000\n  targetPortNumber: 9000"),
     1, "  targetPortNumber: 9000", "spec.targetPortNumber", "duplicate key"),
    ("self-containing alias", "apiVersion: x\nkind: &k\n  a: *k\n", 1, "  a: *k", "kind.a",
     "alias may not refer to a node that contains it"),
    ("unsafe tag", "kind: !!python/object:os.system x\n", 1, "kind: !!python/object:os.system x",
     None, "invalid YAML"),
]


@pytest.mark.parametrize(
    ("text", "document", "line_text", "field", "words"),
    [case[1:] for case in RAW_TEXT_CASES],
    ids=[case[0] for case in RAW_TEXT_CASES],
)
def test_invalid_yaml_is_rejected_with_its_line(
    text: str, document: int, line_text: str, field: str | None, words: str,
    parser: str,
) -> None:
    problems = problems_of(("a.yaml", text))
    line = text.splitlines().index(line_text) + 1
    assert [(p.document, p.line, p.field) for p in problems] == [(document, line, field)]
    assert words in problems[0].message


def test_problem_points_at_the_line_of_the_bad_field() -> None:
    text = dump(POOL, with_spec(MODEL, "targetModels", [{"name": "a"}, {"name": "b",
                                                                         "weight": 0}]))
    [problem] = problems_of(("m.yaml", text))
    bad_line = text.splitlines()[problem.line - 1]  # type: ignore[operator]
    assert bad_line.strip() == "weight: 0"


def test_every_problem_of_every_file_is_reported() -> None:
    problems = problems_of(
        ("a.yaml", dump(with_spec(POOL, "targetPortNumber", 0))),
        ("b.yaml", dump(with_spec(MODEL, "criticality", "Urgent"))),
        ("c.yaml", "kind: [\n"),
    )
    assert [(p.source, p.field) for p in problems] == [
        ("a.yaml", "spec.targetPortNumber"),
        ("b.yaml", "spec.criticality"),
        ("c.yaml", None),
    ]


def test_pool_and_models_may_live_in_different_files_and_duplicates_name_the_first() -> None:
    registry = load(FileSnapshot((SourceFile("p.yaml", dump(POOL)),
                                  SourceFile("m.yaml", dump(MODEL)))))
    assert [m.pool for m in registry.models] == ["pool-a"]
    [problem] = problems_of(("p.yaml", dump(POOL)), ("q.yaml", dump(pool(endpoints=1))))
    assert problem.source == "q.yaml"
    assert "first defined at p.yaml:1" in problem.message


def test_missing_named_path_is_a_problem_but_an_empty_folder_is_an_empty_registry(
    tmp_path: Path,
) -> None:
    snapshot = read_files([str(tmp_path / "nope.yaml")])
    assert [p.message for p in snapshot.problems] == ["no such file or folder"]
    with pytest.raises(InvalidRegistry):
        load(snapshot)
    empty = load(read_files([str(tmp_path)]))
    assert (empty.pools, empty.models, empty.endpoint_sets) == ((), (), ())


def test_folder_reads_yaml_files_in_name_order_and_skips_others(tmp_path: Path) -> None:
    (tmp_path / "b-models.yml").write_text(dump(MODEL))
    (tmp_path / "a-pool.yaml").write_text(dump(POOL))
    (tmp_path / "notes.txt").write_text("kind: nonsense")
    (tmp_path / ".hidden.yaml").write_text("kind: nonsense")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.yaml").write_text("kind: nonsense")
    snapshot = read_files([str(tmp_path)])
    assert [Path(f.path).name for f in snapshot.files] == ["a-pool.yaml", "b-models.yml"]
    assert len(load(snapshot).models) == 1


def test_file_that_is_not_utf8_is_a_problem(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("kind: caf\xe9\n".encode("latin-1"))
    snapshot = read_files([str(path)])
    assert [(p.source, "UTF-8" in p.message) for p in snapshot.problems] == [(str(path), True)]


def test_valid_input_converts_to_wire_messages() -> None:
    documents = [
        pool(metrics={"path": "/stats", "port": 9100}, rejectUnknownModels=True,
             scheduling={"policy": "filter-tree", "params": {"queueing_threshold_lora": 10}}),
        with_spec(pool("pool-b", endpoints=0), "endpoints", DELETE),
        model("base", criticality="Critical"),
        model("legacy", criticality="Default"),
        model("split", targetModels=[{"name": "v1", "weight": 3}, {"name": "v2"}]),
    ]
    documents[0]["spec"]["endpoints"][1].update(port=9000, labels={"zone": "b"})
    registry = load(FileSnapshot((SourceFile("x.yaml", dump(*documents)),)))
    first = registry.pools[0]
    assert (first.name, first.target_port, first.selector) == ("pool-a", 8000, {"app": "pool-a"})
    assert (first.metrics_path, first.metrics_port, first.reject_unknown_models) == (
        "/stats", 9100, True)
    assert (first.policy.name, first.policy.params) == ("filter-tree",
                                                        {"queueing_threshold_lora": 10})
    assert registry.pools[1].policy.name == DEFAULT_POLICY_NAME == "prefix-aware"  # the default
    # Only pools that list endpoints publish an endpoint set; the port defaults to the pool's.
    [endpoints] = registry.endpoint_sets
    assert endpoints.pool == "pool-a"
    assert endpoints.endpoints == (Endpoint("pod-0", "10.0.0.1", 8000),
                                   Endpoint("pod-1", "10.0.0.2", 9000, {"zone": "b"}))
    by_name = {m.model_name: m for m in registry.models}
    assert by_name["base"].criticality is Criticality.CRITICAL
    assert by_name["base"].target_models == (TargetModel("base", 1),)  # upstream default
    assert by_name["legacy"].criticality is Criticality.STANDARD  # v1alpha1's "Default"
    assert by_name["split"].criticality is Criticality.STANDARD
    assert by_name["split"].target_models == (TargetModel("v1", 3), TargetModel("v2", 1))


def test_kubectl_output_with_status_and_server_metadata_is_accepted() -> None:
    document = copy.deepcopy(POOL)
    document["metadata"].update(uid="1234", resourceVersion="7", namespace="default",
                                creationTimestamp="2025-01-01T00:00:00Z")
    document["status"] = {"parent": []}
    document["spec"]["extensionRef"] = {"name": "picker", "portNumber": 9002}
    registry = load(FileSnapshot((SourceFile("k.yaml", dump(document)),)))
    assert registry.pools[0].name == "pool-a"


def test_example_configuration_is_valid(capsys: pytest.CaptureFixture[str]) -> None:
    registry = load(read_files([str(EXAMPLE)]))
    criticalities = {m.model_name: m.criticality for m in registry.models}
    assert criticalities == {
        "meta-llama/Llama-3.1-8B-Instruct": Criticality.CRITICAL,
        "sql-lora": Criticality.SHEDDABLE,
        "tweet-summary": Criticality.STANDARD,
    }
    split = next(m for m in registry.models if m.model_name == "tweet-summary")
    assert [t.name for t in split.target_models] == ["tweet-summary-1", "tweet-summary-2"]
    assert len(registry.endpoint_sets[0].endpoints) == 4


def test_check_prints_summary_or_problems_and_exit_code(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    assert check([str(EXAMPLE)], sys.stdout, sys.stderr) == 0
    out = capsys.readouterr().out
    assert "valid: 1 pool(s), 3 model(s) from 1 file(s)" in out
    assert "tweet-summary-1 90%, tweet-summary-2 10%" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text(dump(POOL, with_spec(MODEL, "targetModels", [{"name": "a", "weight": 0}])))
    assert check([str(bad)], sys.stdout, sys.stderr) == 2
    err = capsys.readouterr().err
    assert f"{bad}:" in err and "document 2: spec.targetModels[0].weight" in err
    assert "invalid: 1 problem(s)" in err


# --- hostile input: every one is a problem naming its place, never an exception ------------------

def nested_flow(levels: int) -> str:
    return "kind: " + "[" * levels + "]" * levels + "\n"


def nested_block(levels: int) -> str:
    return "".join("  " * i + "a:\n" for i in range(levels - 1)) + "  " * (levels - 1) + "a: 1\n"


def laughs(levels: int, width: int = 9) -> str:
    """The "billion laughs" document: ``width ** levels`` strings from a few hundred bytes."""
    items = ", ".join(["lol"] * width)
    lines = [f"l0: &l0 [{items}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nkind: *l{levels - 1}\n"


def merge_chain(length: int, fan: int = 1) -> str:
    """Mappings each merging the previous one (``<<``), ``fan`` times."""
    lines = ["m0: &m0 {x: 1}"]
    lines += [f"m{i}: &m{i} {{<<: [{', '.join([f'*m{i - 1}'] * fan)}], y{i}: 1}}"
              for i in range(1, length)]
    return "\n".join(lines) + "\n"


# (case id, raw YAML text, document, line, field, words in the message)
HOSTILE_CASES = [
    ("500 levels of flow sequences (1 KB)", nested_flow(500), 1, 1,
     "kind[0][0][0][0][0][0][0]...", "nested deeper than 64 levels"),
    ("500 levels of block mappings", nested_block(500), 1, 64, "a.a.a.a.a.a.a.a...",
     "nested deeper than 64 levels"),
    ("billion laughs", laughs(9), 1, 7, "l6", "more than 1,000,000 values in one document"),
    ("a chain of 1,000 merge keys", merge_chain(1000), 1, 33, "m32.<<",
     "nested deeper than 64 levels (aliases expanded)"),
    ("merge keys doubling 30 times", merge_chain(30, fan=2), 1, 18, "m17.<<",
     "more than 1,000,000 values"),
    ("integer of 5,000 digits", dump(with_spec(POOL, "targetPortNumber", 1)).replace(
        "targetPortNumber: 1", "targetPortNumber: " + "9" * 5000), 1, 8,
     "spec.targetPortNumber", "cannot read int value: Exceeds the limit (4300 digits)"),
    ("date in month 13", "kind: 2001-13-45\n", 1, 1, "kind",
     "cannot read timestamp value: month must be in 1..12"),
    ("explicit int tag on a word", "apiVersion: !!int abc\n", 1, 1, "apiVersion",
     "cannot read int value"),
    ("explicit float tag on a word", "a: {b: !!float abc}\n", 1, 1, "a.b",
     "cannot read float value"),
    ("NUL character", "kind: a\x00b\n", None, 1, None, "unacceptable character #x0000"),
    ("control character on line 3", "a: 1\nb: 2\nc: \x07\n", None, 3, None,
     "unacceptable character #x0007"),
]


@pytest.mark.parametrize(
    ("text", "document", "line", "field", "words"),
    [case[1:] for case in HOSTILE_CASES],
    ids=[case[0] for case in HOSTILE_CASES],
)
def test_hostile_yaml_is_a_problem_with_its_place_not_an_exception(
    text: str, document: int | None, line: int, field: str | None, words: str,
    parser: str,
) -> None:
    started = time.monotonic()
    problems = problems_of(("evil.yaml", text))
    assert time.monotonic() - started < 2.0  # nothing expanded the aliases
    assert [(p.source, p.document, p.line, p.field) for p in problems] == [
        ("evil.yaml", document, line, field)], problems
    assert words in problems[0].message
    assert "\n" not in str(problems[0])


def test_nesting_and_aliases_within_the_limits_are_accepted(parser: str) -> None:
    status: dict[str, Any] = {}
    deep = status
    for _ in range(58):  # ignored by validation, but parsed: 60 levels in all
        deep["x"] = deep = {}
    text = dump({**POOL, "status": status}).replace(
        "metadata:\n  name: pool-a\n", "metadata:\n  name: pool-a\n  labels: &l {zone: a}\n",
        1).replace("  selector:\n    app: pool-a\n", "  selector: *l\n", 1)
    assert text.count("x:") == 58
    registry = load(FileSnapshot((SourceFile("ok.yaml", text),)))
    assert registry.pools[0].selector == {"zone": "a"}


def test_long_or_strange_values_are_quoted_short_in_problems() -> None:
    [problem] = problems_of(("k.yaml", "kind: " + "x" * 100_000 + "\n"))
    assert "unknown kind 'xxx" in problem.message and len(problem.message) < 200
    [problem] = problems_of(("k.yaml", dump(with_spec(POOL, "endpoints[0].address",
                                                      "h" * 10_000))))
    assert problem.field == "spec.endpoints[0].address" and len(problem.message) < 200


# Pieces of YAML syntax, tags whose constructors raise, and pathological values.
FUZZ_PIECES = [
    *"[]{}:,-&*!<>|'\"#%@`?\\ \t\n\r0123456789aex.+_/\x00\x85\ufeff",
    "!!int ", "!!float ", "!!binary ", "!!timestamp ", "!!set ", "!!python/name:x ", "2001-13-45",
    "<<: ", "&a ", "*a", "---\n", "...\n", "%YAML 1.1\n", "0x", "9" * 5000, "[" * 100,
    "kind: InferencePool\n",
]


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(text=st.lists(st.sampled_from(FUZZ_PIECES), max_size=60).map("".join))
def test_any_text_loads_or_is_rejected_with_problems(text: str, parser: str) -> None:
    try:
        load(FileSnapshot((SourceFile("fuzz.yaml", text),)))
    except InvalidRegistry as exc:
        assert exc.problems and all(p.source == "fuzz.yaml" for p in exc.problems)


def test_file_over_the_size_limit_is_a_problem_and_not_read_whole(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    with big.open("wb") as out:
        out.truncate(MAX_FILE_BYTES + 1)  # sparse: no 16 MiB written
    snapshot = read_files([str(big)])
    assert snapshot.files == ()
    assert [p.message for p in snapshot.problems] == ["larger than the limit of 16 MiB per file"]


# (address, words in the problem)
UNUSABLE_ADDRESSES = [
    ("0.0.0.0", "the unspecified address"),
    ("::", "the unspecified address"),
    ("::ffff:0.0.0.0", "the unspecified address"),
    ("224.0.0.1", "a multicast address"),
    ("ff02::1", "a multicast address"),
    ("255.255.255.255", "the broadcast address"),
]


@pytest.mark.parametrize(("address", "words"), UNUSABLE_ADDRESSES,
                         ids=[a for a, _ in UNUSABLE_ADDRESSES])
def test_unusable_endpoint_address_is_refused(address: str, words: str) -> None:
    [problem] = problems_of(("p.yaml", dump(with_spec(POOL, "endpoints[1].address", address))))
    assert problem.field == "spec.endpoints[1].address"
    assert words in problem.message and repr(address) in problem.message


def test_loopback_and_ordinary_addresses_stay_allowed() -> None:
    # Usable addresses: the pool's allowedNetworks (test_registry_networks.py) still decide.
    networks = ["127.0.0.0/8", "::1/128", "10.0.0.0/8", "fd00::/8", "169.254.0.0/16"]
    for address in ("127.0.0.1", "::1", "10.1.2.3", "fd00::5", "169.254.1.1"):
        pool = with_spec(with_spec(POOL, "endpoints[0].address", address),
                         "allowedNetworks", networks)
        registry = load(FileSnapshot((SourceFile("p.yaml", dump(pool)),)))
        assert registry.endpoint_sets[0].endpoints[0].address == address


# (case id, override file text, words in the error)
BAD_OVERRIDES = [
    ("not a mapping", "- 1\n", "Expected `object`"),
    ("unknown field", "pool: p\nendpoints: [{name: a, address: 10.0.0.1}]\nports: 1\n",
     "unknown field `ports`"),
    ("no endpoints", "pool: p\nendpoints: []\n", "lists no endpoints"),
    ("unspecified address", "pool: p\nendpoints: [{name: a, address: 0.0.0.0, port: 1}]\n",
     "endpoints[0].address: '0.0.0.0' is the unspecified address"),
    ("YAML syntax", "pool: [\n", "expected"),
]


@pytest.mark.parametrize(("text", "words"), [case[1:] for case in BAD_OVERRIDES],
                         ids=[case[0] for case in BAD_OVERRIDES])
def test_unusable_endpoints_override_is_a_clear_error(tmp_path: Path, text: str,
                                                      words: str) -> None:
    path = tmp_path / "override.yaml"
    path.write_text(text)
    with pytest.raises(OverrideError) as caught:
        read_override(str(path))
    assert str(caught.value).startswith(f"{path}: ") and words in str(caught.value)
    with pytest.raises(OverrideError, match="No such file"):
        read_override(str(tmp_path / "missing.yaml"))


def test_endpoints_override_replaces_only_its_pools_endpoints(tmp_path: Path) -> None:
    registry = load(FileSnapshot((SourceFile("r.yaml", dump(POOL, pool("pool-b"), MODEL)),)))
    path = tmp_path / "override.yaml"
    path.write_text("pool: pool-b\nendpoints:\n  - {name: sim-0, address: 127.0.0.1}\n"
                    "  - {name: sim-1, address: 127.0.0.1, port: 9001}\n")
    overridden, found = apply_override(registry, read_override(str(path)))
    assert found
    sets = {s.pool: s.endpoints for s in overridden.endpoint_sets}
    assert sets["pool-b"] == (Endpoint("sim-0", "127.0.0.1", 8000),
                              Endpoint("sim-1", "127.0.0.1", 9001))
    assert sets["pool-a"] == registry.endpoint_sets[0].endpoints
    assert (overridden.pools, overridden.models) == (registry.pools, registry.models)
    path.write_text("pool: elsewhere\nendpoints: [{name: a, address: 127.0.0.1}]\n")
    assert apply_override(registry, read_override(str(path))) == (registry, False)


def test_check_of_an_empty_folder_says_a_running_registry_would_refuse_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    assert check([str(tmp_path)], sys.stdout, sys.stderr) == 0
    assert capsys.readouterr().out.splitlines() == [
        "valid: 0 pool(s), 0 model(s) from 0 file(s)",
        "note: no pools; a running registry refuses to publish this over published pools unless "
        "--allow-empty (docs/registry.md)"]


def test_check_warns_of_a_model_name_in_two_pools(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    twin = {**model(pool_name="pool-b"), "metadata": {"name": "model-a-in-b"}}
    path = tmp_path / "two.yaml"
    path.write_text(dump(POOL, MODEL, pool("pool-b"), twin))
    assert check([str(path)], sys.stdout, sys.stderr) == 0
    out = capsys.readouterr().out
    assert ("warning: modelName 'model-a' is registered in pools pool-a, pool-b: a picker "
            "serving several of them routes it to one pool only") in out
