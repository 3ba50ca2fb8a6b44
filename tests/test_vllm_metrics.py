"""The vLLM metrics parser: fixture pages, table cases, errors, and properties."""

from __future__ import annotations

import math
import random
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from shared.vllm_metrics import (
    CACHE_CONFIG,
    FAMILIES,
    GPU_CACHE_USAGE,
    KV_CACHE_USAGE,
    LORA_INFO,
    RUNNING,
    WAITING,
    MetricsParseError,
    ParsedMetrics,
    parse_vllm_metrics,
    present_families,
)

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"
PAGES = {path.name: path.read_bytes() for path in sorted(FIXTURES.glob("*.txt"))}

# What tests/fixtures/metrics/generate.py put on each page.
EXPECTED = {
    "vllm_v1.txt": ParsedMetrics(
        waiting=7,
        running=24,
        kv_cache_usage=0.4375,
        running_adapters=("sql-lora", "chat-lora"),
        waiting_adapters=("summarize-lora",),
        max_lora=4,
        block_size=16,
        num_gpu_blocks=27910,
        missing=(),
    ),
    "vllm_v0.txt": ParsedMetrics(
        waiting=2,
        running=9,
        kv_cache_usage=0.8125,
        running_adapters=(),  # the newest state has no adapters: a real state, not "unknown"
        waiting_adapters=(),
        max_lora=2,
        block_size=16,
        num_gpu_blocks=12850,
        missing=(),
    ),
    "vllm_v1_openmetrics.txt": ParsedMetrics(
        waiting=3 + 6,  # two data-parallel engines: queues add up
        running=17 + 12,
        kv_cache_usage=(0.0625 + 0.1875) / 2,  # and KV usage is their mean
        running_adapters=("sql-lora", "chat-lora"),
        waiting_adapters=(),
        max_lora=2,
        block_size=16,
        num_gpu_blocks=7282,
        missing=(),
    ),
}

LORA = (
    "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
    "# TYPE vllm:lora_requests_info gauge\n"
)
ALL_MISSING = (WAITING, RUNNING, KV_CACHE_USAGE, GPU_CACHE_USAGE, LORA_INFO, CACHE_CONFIG)


def parsed(page: str) -> ParsedMetrics:
    return parse_vllm_metrics(page.encode())


# --- the fixture pages ------------------------------------------------------------------------


def test_fixtures_are_the_pages_described() -> None:
    assert set(PAGES) == set(EXPECTED)
    assert 55_000 <= len(PAGES["vllm_v1.txt"]) <= 65_000  # the realistic size the benchmark uses


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_page(name: str) -> None:
    assert parse_vllm_metrics(PAGES[name]) == EXPECTED[name]


def reference(page: bytes) -> ParsedMetrics:
    """The same reading done with prometheus_client's full parser (lenient text parser; its
    OpenMetrics parser rejects the OpenMetrics page prometheus_client itself writes for vLLM)."""
    samples: dict[str, list] = {family: [] for family in FAMILIES}
    for metric in text_string_to_metric_families(page.decode()):
        for sample in metric.samples:
            canonical = sample.name.replace("vllm_", "vllm:", 1)
            if canonical in samples:
                samples[canonical].append(sample)
    kv = samples[KV_CACHE_USAGE] or samples[GPU_CACHE_USAGE]
    lora = max(samples[LORA_INFO], key=lambda s: s.value, default=None)
    cache = samples[CACHE_CONFIG][0].labels if samples[CACHE_CONFIG] else None

    def adapters(label: str) -> tuple[str, ...] | None:
        return tuple(filter(None, lora.labels[label].split(","))) if lora else None

    return ParsedMetrics(
        waiting=round(sum(s.value for s in samples[WAITING])) if samples[WAITING] else None,
        running=round(sum(s.value for s in samples[RUNNING])) if samples[RUNNING] else None,
        kv_cache_usage=sum(s.value for s in kv) / len(kv) if kv else None,
        running_adapters=adapters("running_lora_adapters"),
        waiting_adapters=adapters("waiting_lora_adapters"),
        max_lora=int(lora.labels["max_lora"]) if lora else None,
        block_size=int(cache["block_size"]) if cache else None,
        num_gpu_blocks=int(cache["num_gpu_blocks"]) if cache else None,
        missing=(),
    )


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_prometheus_client_reads_the_same_values(name: str) -> None:
    assert parse_vllm_metrics(PAGES[name]) == reference(PAGES[name])


def test_present_families() -> None:
    assert present_families(PAGES["vllm_v1.txt"]) == FAMILIES
    assert GPU_CACHE_USAGE in present_families(PAGES["vllm_v0.txt"])
    assert KV_CACHE_USAGE not in present_families(PAGES["vllm_v0.txt"])


# --- table cases ------------------------------------------------------------------------------

V1_ENGINE = '{engine="0",model_name="m"}'
CASES = {
    "v1 names": (
        f"vllm:num_requests_waiting{V1_ENGINE} 4.0\n"
        f"vllm:num_requests_running{V1_ENGINE} 2.0\n"
        f"vllm:kv_cache_usage_perc{V1_ENGINE} 0.5\n",
        {"waiting": 4, "running": 2, "kv_cache_usage": 0.5},
    ),
    "v0 gpu_cache_usage_perc when the v1 name is absent": (
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.75\n',
        {"kv_cache_usage": 0.75},
    ),
    "v1 name wins over the v0 name": (
        f"vllm:gpu_cache_usage_perc{V1_ENGINE} 0.9\nvllm:kv_cache_usage_perc{V1_ENGINE} 0.25\n",
        {"kv_cache_usage": 0.25},
    ),
    "openmetrics spelling with timestamps, exemplar and EOF": (
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm_num_requests_waiting{V1_ENGINE} 3.0 1747300000.5\n"
        f"vllm_kv_cache_usage_perc{V1_ENGINE} 0.125\n"
        f'vllm_num_requests_running{V1_ENGINE} 1 # {{trace_id="ab"}} 1.0 1747300000\n'
        "# EOF\n",
        {"waiting": 3, "kv_cache_usage": 0.125, "running": 1},
    ),
    "escaped quotes, commas and spaces in label values": (
        'vllm:num_requests_waiting{model_name="org/m \\"v2\\", chat",engine="0"} 5\n'
        'vllm:num_requests_waiting{model_name="a\\\\b\\nc",engine="1"} 6\n',
        {"waiting": 11},
    ),
    "labels in any order, spaces around them, a trailing comma": (
        LORA
        + 'vllm:lora_requests_info{running_lora_adapters="a",max_lora="3",'
        'waiting_lora_adapters="b"} 10\n'
        'vllm:lora_requests_info{ waiting_lora_adapters = "" , max_lora="3",'
        'running_lora_adapters="x,y" , } 20\n',
        {"running_adapters": ("x", "y"), "waiting_adapters": (), "max_lora": 3},
    ),
    "exponents": (
        f"vllm:num_requests_waiting{V1_ENGINE} 1.2e+01\n"
        f"vllm:num_requests_running{V1_ENGINE} 3E0\n"
        f"vllm:kv_cache_usage_perc{V1_ENGINE} 2.5e-1\n",
        {"waiting": 12, "running": 3, "kv_cache_usage": 0.25},
    ),
    "NaN and +Inf in families the gateway does not read": (
        f"vllm:cpu_prefix_cache_hit_rate{V1_ENGINE} NaN\n"
        f'vllm:e2e_request_latency_seconds_bucket{{engine="0",le="+Inf"}} +Inf\n'
        f"vllm:num_requests_waiting{V1_ENGINE} 2\n",
        {"waiting": 2},
    ),
    "_created and _total samples that extend a wanted name": (
        f"vllm:num_requests_running_total{V1_ENGINE} 999\n"
        f"vllm:kv_cache_usage_perc_created{V1_ENGINE} 1.7473e+09\n"
        f"vllm:num_preemptions_total{V1_ENGINE} 4\n"
        f"vllm:num_preemptions_created{V1_ENGINE} 1.7473e+09\n"
        f"vllm:num_requests_running{V1_ENGINE} 8\n"
        f"vllm:kv_cache_usage_perc{V1_ENGINE} 0.5\n",
        {"running": 8, "kv_cache_usage": 0.5},
    ),
    "a family whose name extends another is not read as it": (
        f'vllm:num_requests_waiting_by_reason{{engine="0",reason="capacity"}} 40\n'
        f"vllm:num_requests_waiting{V1_ENGINE} 1\n"
        f'vllm:num_requests_waiting_by_reason{{engine="0",reason="deferred"}} 50\n',
        {"waiting": 1},
    ),
    "data-parallel engines: queues add up, KV usage averages": (
        "".join(
            f'vllm:num_requests_waiting{{engine="{e}",model_name="m"}} {e + 1}\n'
            f'vllm:num_requests_running{{engine="{e}",model_name="m"}} {10 * e}\n'
            f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="m"}} {0.25 * e}\n'
            for e in range(3)
        ),
        {"waiting": 6, "running": 30, "kv_cache_usage": 0.25},
    ),
    "newest lora series by value, not by position": (
        LORA
        + 'vllm:lora_requests_info{max_lora="4",running_lora_adapters="new",'
        'waiting_lora_adapters=""} 1.7473005e+09\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",'
        'waiting_lora_adapters="w"} 1.7473e+09\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="nan",'
        'waiting_lora_adapters=""} NaN\n',
        {"running_adapters": ("new",), "waiting_adapters": (), "max_lora": 4},
    ),
    "empty adapter lists are a state": (
        LORA + 'vllm:lora_requests_info{max_lora="1",running_lora_adapters="",'
        'waiting_lora_adapters=""} 5\n',
        {"running_adapters": (), "waiting_adapters": (), "max_lora": 1},
    ),
    "cache config labels, num_gpu_blocks not yet known": (
        'vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",'
        'num_gpu_blocks="None"} 1.0\n',
        {"block_size": 32, "num_gpu_blocks": None},
    ),
    "a wanted sample on the first line, CRLF endings, no final newline": (
        f"vllm:num_requests_waiting{V1_ENGINE} 9\r\nvllm:num_requests_running 4\r\n"
        f"vllm:kv_cache_usage_perc{V1_ENGINE}\t0.5",
        {"waiting": 9, "running": 4, "kv_cache_usage": 0.5},
    ),
    "kv usage is clamped to 0..1": (
        'vllm:kv_cache_usage_perc{engine="0"} 1.0000002\nvllm:kv_cache_usage_perc{engine="1"} 1\n',
        {"kv_cache_usage": 1.0},
    ),
}


@pytest.mark.parametrize("page,fields", list(CASES.values()), ids=list(CASES))
def test_case(page: str, fields: dict) -> None:
    result = parsed(page)
    for field, value in fields.items():
        assert getattr(result, field) == value, field
    # Every other field stays unknown, and the families behind unknown fields are reported.
    defaults = {f: None for f in ParsedMetrics.__struct_fields__ if f != "missing"}
    for field in defaults.keys() - fields.keys():
        assert getattr(result, field) is None, field
    expected_missing = [
        family
        for family, field in (
            (WAITING, "waiting"),
            (RUNNING, "running"),
            (KV_CACHE_USAGE, "kv_cache_usage"),
            (GPU_CACHE_USAGE, "kv_cache_usage"),
            (LORA_INFO, "max_lora"),
            (CACHE_CONFIG, "block_size"),
        )
        if field not in fields
    ]
    assert list(result.missing) == expected_missing


def test_exporter_without_vllm_families_is_all_missing() -> None:
    page = "# HELP up Up.\n# TYPE up gauge\nup 1\nnode_load1{cpu=\"0\"} 0.25 1700000000\n"
    unknown = dict.fromkeys(ParsedMetrics.__struct_fields__)
    assert parsed(page) == ParsedMetrics(**unknown | {"missing": ALL_MISSING})


def test_declared_family_without_samples_is_missing() -> None:
    result = parsed(LORA + 'vllm:num_requests_waiting{engine="0"} 1\n')
    assert result.max_lora is None
    assert LORA_INFO in result.missing


# --- errors -----------------------------------------------------------------------------------

ERRORS = {
    "empty page": ("", "empty page"),
    "whitespace only": ("  \n\n", "empty page"),
    "HTML error page": ("<html><body>502 Bad Gateway</body></html>\n", "line 1"),
    "JSON": ('{"waiting": 3}\n', "line 1"),
    "not UTF-8": ("up 1\n\udcff\n", "UTF-8"),
    "unterminated label set": ('vllm:num_requests_waiting{engine="0 3\n', "label set"),
    "missing value": ('# c\nvllm:num_requests_waiting{engine="0"}\n', "line 2"),
    "value not a number": ("vllm:num_requests_running abc\n", "not a number"),
    "timestamp not a number": ("vllm:num_requests_running 1 soon\n", "not a number"),
    "NaN queue": ("vllm:num_requests_waiting NaN\n", "queue length"),
    "negative queue": ("vllm:num_requests_running -2\n", "queue length"),
    "infinite KV usage": ("vllm:kv_cache_usage_perc +Inf\n", "finite"),
    "max_lora not an integer": (
        LORA + 'vllm:lora_requests_info{max_lora="four",running_lora_adapters=""} 1\n',
        "max_lora",
    ),
    "block_size not an integer": ('vllm:cache_config_info{block_size="16.5"} 1\n', "block_size"),
    "huge queues overflow": (
        'vllm:num_requests_waiting{e="0"} 1e308\nvllm:num_requests_waiting{e="1"} 1e308\n',
        "queue",
    ),
}


@pytest.mark.parametrize("page,message", list(ERRORS.values()), ids=list(ERRORS))
def test_error(page: str, message: str) -> None:
    with pytest.raises(MetricsParseError, match=message):
        parse_vllm_metrics(page.encode(errors="surrogateescape"))


def test_error_names_the_line() -> None:
    page = PAGES["vllm_v1.txt"].replace(
        b'vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 24.0',
        b'vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct} 24.0',
    )
    line = page[: page.index(b"vllm:num_requests_running{")].count(b"\n") + 1
    with pytest.raises(MetricsParseError, match=f"^line {line}: malformed label set"):
        parse_vllm_metrics(page)


def test_non_utf8_adapter_name_is_an_error() -> None:
    page = LORA.encode() + b'vllm:lora_requests_info{running_lora_adapters="\xff"} 1\n'
    with pytest.raises(MetricsParseError, match="UTF-8"):
        parse_vllm_metrics(page)


# --- properties -------------------------------------------------------------------------------

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def parse_or_error(page: bytes) -> ParsedMetrics | None:
    """The parser's result, or None for its own error; any other exception fails the test."""
    try:
        return parse_vllm_metrics(page)
    except MetricsParseError:
        return None


@FUZZ
@given(st.binary(max_size=2000))
def test_random_bytes_never_raise_anything_else(page: bytes) -> None:
    parse_or_error(page)


def line_starts(page: bytes, prefixes: tuple[bytes, ...]) -> list[int]:
    """Offsets of the lines of ``page`` that start with one of ``prefixes``."""
    lines = page.split(b"\n")
    offsets = [0]
    for line in lines[:-1]:
        offsets.append(offsets[-1] + len(line) + 1)
    return [at for at, line in zip(offsets, lines, strict=True) if line.startswith(prefixes)]


# Mutations aim at the lines the parser reads, where most of its code runs.
WANTED = tuple(
    spelling.encode() for family in FAMILIES for spelling in (family, family.replace(":", "_"))
)
WANTED_STARTS = {name: line_starts(page, WANTED) for name, page in PAGES.items()}


@FUZZ
@given(
    name=st.sampled_from(WANTED), after=st.sampled_from([b"{", b" ", b"\t"]), rest=st.binary()
)
def test_wanted_names_then_random_bytes_never_raise_anything_else(
    name: bytes, after: bytes, rest: bytes
) -> None:
    parse_or_error(b"# TYPE x gauge\n" + name + after + rest)


NASTY = st.sampled_from(
    [
        *(b'"', b"\\", b"{", b"}", b",", b"=", b" ", b"\t", b"\n", b"\r", b"#", b"\xff", b"\x00"),
        *(b"NaN", b"+Inf", b"-", b"1e999", b"None", b'max_lora="x"', b"vllm:num_requests_waiting"),
    ]
)


@FUZZ
@given(
    name=st.sampled_from(sorted(PAGES)),
    line=st.integers(min_value=0),
    offset=st.integers(min_value=0, max_value=400),
    cut=st.integers(min_value=0, max_value=40),
    insert=st.lists(st.one_of(NASTY, st.binary(max_size=8)), max_size=4).map(b"".join),
)
def test_mutated_pages_never_raise_anything_else(
    name: str, line: int, offset: int, cut: int, insert: bytes
) -> None:
    page = PAGES[name]
    starts = WANTED_STARTS[name]
    at = min(starts[line % len(starts)] + offset, len(page))
    parse_or_error(page[:at] + insert + page[at + cut :])


@FUZZ
@given(name=st.sampled_from(sorted(PAGES)), at=st.floats(0, 1), keep=st.floats(0, 1))
def test_truncated_pages_never_raise_anything_else(name: str, at: float, keep: float) -> None:
    page = PAGES[name]
    start = int(at * len(page))
    parse_or_error(page[start : start + int(keep * (len(page) - start))])


BUCKET_LINES = [
    (start, PAGES["vllm_v1.txt"].index(b"\n", start))
    for start in line_starts(PAGES["vllm_v1.txt"], (b"vllm:",))
    if PAGES["vllm_v1.txt"].startswith(b"_bucket{", PAGES["vllm_v1.txt"].index(b"{", start) - 7)
]


@FUZZ
@given(
    line=st.integers(min_value=0, max_value=len(BUCKET_LINES) - 1),
    replacement=st.binary(min_size=1, max_size=30).map(lambda b: b.replace(b"\n", b" ")),
    offset=st.integers(min_value=0, max_value=200),
)
def test_lines_the_parser_does_not_read_do_not_matter(
    line: int, replacement: bytes, offset: int
) -> None:
    page = PAGES["vllm_v1.txt"]
    start, end = BUCKET_LINES[line]
    at = min(start + 1 + offset, end)  # never the first byte: the line stays a histogram's
    assert parse_vllm_metrics(page[:at] + replacement + page[at:]) == EXPECTED["vllm_v1.txt"]


@st.composite
def generated_pages(draw: st.DrawFn) -> tuple[bytes, ParsedMetrics]:
    """A page of random engines and LoRA series, in either spelling, with shuffled labels and
    lines, and what the parser must read from it."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    prefix = draw(st.sampled_from(["vllm:", "vllm_"]))
    model = draw(st.text(st.characters(codec="utf-8", exclude_characters="\n"), max_size=12))
    escaped = model.replace("\\", "\\\\").replace('"', '\\"')
    engines = draw(st.integers(1, 4))
    waiting = [draw(st.integers(0, 10_000)) for _ in range(engines)]
    running = [draw(st.integers(0, 1_000)) for _ in range(engines)]
    kv = [draw(st.floats(0, 1)) for _ in range(engines)]

    def labels(pairs: dict[str, str]) -> str:
        items = list(pairs.items())
        rng.shuffle(items)
        return "{" + ",".join(f'{k}="{v}"' for k, v in items) + "}"

    lines = []
    for e in range(engines):
        common = {"engine": str(e), "model_name": escaped}
        lines += [
            f"{prefix}num_requests_waiting{labels(common)} {float(waiting[e])!r}",
            f"{prefix}num_requests_waiting_by_reason{labels(common | {'reason': 'x'})} 77",
            f"{prefix}num_requests_running{labels(common)} {running[e]:e}",
            f"{prefix}kv_cache_usage_perc{labels(common)} {kv[e]!r}",
            f"{prefix}kv_cache_usage_perc_created{labels(common)} 1.7e9",
        ]
    adapters = st.sets(st.sampled_from(["a", "b-lora", "c_1"]))
    states = draw(st.lists(st.tuples(adapters, adapters), min_size=1, max_size=6))
    times = rng.sample(range(1_000_000), len(states))  # distinct: one newest series
    for (run, wait), t in zip(states, times, strict=True):
        pairs = {
            "max_lora": "4",
            "running_lora_adapters": ",".join(sorted(run)),
            "waiting_lora_adapters": ",".join(sorted(wait)),
        }
        lines.append(f"{prefix}lora_requests_info{labels(pairs)} {1.7e9 + t!r}")
    rng.shuffle(lines)
    newest_run, newest_wait = states[times.index(max(times))]
    expected = ParsedMetrics(
        waiting=sum(waiting),
        running=sum(running),
        kv_cache_usage=sum(kv) / engines,
        running_adapters=tuple(sorted(newest_run)),
        waiting_adapters=tuple(sorted(newest_wait)),
        max_lora=4,
        block_size=None,
        num_gpu_blocks=None,
        missing=(CACHE_CONFIG,),
    )
    return "\n".join(lines).encode() + b"\n", expected


@FUZZ
@given(generated_pages())
def test_generated_pages(case: tuple[bytes, ParsedMetrics]) -> None:
    page, expected = case
    result = parse_vllm_metrics(page)
    assert math.isclose(result.kv_cache_usage, expected.kv_cache_usage, abs_tol=1e-12)
    assert result == msgspec.structs.replace(expected, kv_cache_usage=result.kv_cache_usage)
