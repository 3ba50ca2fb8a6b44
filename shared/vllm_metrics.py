"""Read the vLLM gauges the gateway schedules on from the raw bytes of a ``/metrics`` page.

The collector parses every pod 20 times a second, so this module never runs a general
Prometheus parser over the page (prometheus_client's takes ~20-30 ms on a 60 KB vLLM page). One
regex pass (C speed) finds the sample lines of the few families it needs, and only those lines
are parsed: about 0.1 ms for such a page (``bench/bench_metrics_parser.py``).

Pages come in two spellings: the Prometheus text format keeps vLLM's ``vllm:`` names, while the
OpenMetrics exposition of prometheus_client (and some exporters) writes ``vllm_``. Both are read;
missing families are reported under the ``vllm:`` name.
"""

from __future__ import annotations

import math
import re

import msgspec

from shared.errors import LigError

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
GPU_CACHE_USAGE = "vllm:gpu_cache_usage_perc"  # the V0 name, read when the V1 name is absent
LORA_INFO = "vllm:lora_requests_info"
CACHE_CONFIG = "vllm:cache_config_info"

FAMILIES: tuple[str, ...] = (
    WAITING,
    RUNNING,
    KV_CACHE_USAGE,
    GPU_CACHE_USAGE,
    LORA_INFO,
    CACHE_CONFIG,
)


class MetricsParseError(LigError, ValueError):
    """The page is not a Prometheus exposition, or a line the gateway needs is malformed."""


class ParsedMetrics(msgspec.Struct, frozen=True):
    """What the gateway reads from one page; ``None`` where the family was absent.

    ``missing`` names (``vllm:`` spelling) the families whose fields stayed ``None``; when
    neither KV-cache family is present both names are listed.
    """

    waiting: int | None
    running: int | None
    kv_cache_usage: float | None
    running_adapters: tuple[str, ...] | None
    waiting_adapters: tuple[str, ...] | None
    max_lora: int | None
    block_size: int | None
    num_gpu_blocks: int | None
    missing: tuple[str, ...]


# One parsed sample line: its raw label set (``{...}`` as on the page, b"" if none), its value,
# and where the line starts (for error messages).
_Sample = tuple[bytes, float, int]
# Where a sample line lies: (line start, name end, line end).
_Span = tuple[int, int, int]

# The name of a wanted family at the start of a line, in either spelling. It must end where the
# labels or the value start: ``vllm:num_requests_waiting_by_reason`` only shares the prefix.
_WANTED = rb"(vllm[:_](?:%s))(?=[{ \t])" % b"|".join(
    re.escape(family.removeprefix("vllm:").encode()) for family in FAMILIES
)
_WANTED_AFTER_NEWLINE = re.compile(rb"\n" + _WANTED)  # one C-speed pass finds every wanted line
_WANTED_AT_START = re.compile(_WANTED)
_CANONICAL = {
    spelling: family
    for family in FAMILIES
    for spelling in (family.encode(), family.replace(":", "_", 1).encode())
}

# A label value may hold escaped quotes, commas and spaces: name="a \"b\", c". The unrolled
# loop in _IN_QUOTES (no alternation per character) keeps these regexes fast.
_LABEL_NAME = rb"[A-Za-z_][A-Za-z0-9_]*"
_IN_QUOTES = rb'[^"\\\n]*(?:\\.[^"\\\n]*)*'
_PAIR = _LABEL_NAME + rb'[ \t]*=[ \t]*"' + _IN_QUOTES + b'"'
_LABEL_SET = re.compile(
    rb"\{[ \t]*(?:" + _PAIR + rb"(?:[ \t]*,[ \t]*" + _PAIR + rb")*[ \t]*,?[ \t]*)?\}"
)
_LABEL_PAIRS = re.compile(b"(" + _LABEL_NAME + rb')[ \t]*=[ \t]*"(' + _IN_QUOTES + b')"')
# Value, optional timestamp, optional OpenMetrics exemplar; ``$`` is the line end (``endpos``).
_VALUE = re.compile(rb"[ \t]+(\S+)(?:[ \t]+([^#\s]\S*))?[ \t]*(?:#.*)?\r?$")
_METRIC_NAME = re.compile(rb"[ \t]*[A-Za-z_:][A-Za-z0-9_:]*(?=[{ \t])")
_ESCAPE = re.compile(r"\\(.)")
_UNESCAPED = {"n": "\n", "\\": "\\", '"': '"'}


def parse_vllm_metrics(page: bytes) -> ParsedMetrics:
    """Read queue lengths, KV-cache usage, LoRA state and cache config from a ``/metrics`` page.

    Several series of a queue or KV family (data-parallel ``engine`` labels) are combined: queues
    are summed, KV usage is averaged and clamped to 0..1. ``vllm:lora_requests_info`` keeps every
    label combination it ever emitted with a timestamp as value, so the series with the largest
    value is the current state (empty adapter lists included). ``block_size`` and
    ``num_gpu_blocks`` come from the first ``vllm:cache_config_info`` series (per engine, as
    vLLM reports them).

    Raises :class:`MetricsParseError` (and nothing else) for a page that is not a Prometheus
    exposition or whose needed lines are malformed.
    """
    lines = _wanted_lines(page)
    waiting = _samples(page, lines, WAITING)
    running = _samples(page, lines, RUNNING)
    kv_family = KV_CACHE_USAGE if KV_CACHE_USAGE in lines else GPU_CACHE_USAGE
    kv = _samples(page, lines, kv_family)
    lora = _samples(page, lines, LORA_INFO)
    cache = _samples(page, lines, CACHE_CONFIG)
    if not lines:
        # Nothing of vLLM's: only now pay for a whole-page check, to tell an exporter without
        # vLLM families from an HTML error page or random bytes.
        _check_exposition(page)

    missing: list[str] = []
    if not waiting:
        missing.append(WAITING)
    if not running:
        missing.append(RUNNING)
    if not kv:
        missing += (KV_CACHE_USAGE, GPU_CACHE_USAGE)
    running_adapters = waiting_adapters = None
    max_lora = None
    if lora:
        running_adapters, waiting_adapters, max_lora = _lora_state(page, lora)
    else:
        missing.append(LORA_INFO)
    block_size = num_gpu_blocks = None
    if cache:
        block_size, num_gpu_blocks = _cache_config(page, cache)
    else:
        missing.append(CACHE_CONFIG)

    return ParsedMetrics(
        waiting=_queue_length(page, waiting) if waiting else None,
        running=_queue_length(page, running) if running else None,
        kv_cache_usage=_mean_usage(page, kv_family, kv) if kv else None,
        running_adapters=running_adapters,
        waiting_adapters=waiting_adapters,
        max_lora=max_lora,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        missing=tuple(missing),
    )


def present_families(page: bytes) -> tuple[str, ...]:
    """The names (``vllm:`` spelling) of the families in :data:`FAMILIES` that have samples."""
    lines = _wanted_lines(page)
    return tuple(family for family in FAMILIES if family in lines)


def _wanted_lines(page: bytes) -> dict[str, list[_Span]]:
    """The sample lines of the wanted families, by family, in page order."""
    lines: dict[str, list[_Span]] = {}
    first = _WANTED_AT_START.match(page)
    for match in ([first] if first else []) + list(_WANTED_AFTER_NEWLINE.finditer(page)):
        start, name_end = match.span(1)
        end = page.find(b"\n", name_end)
        lines.setdefault(_CANONICAL[match[1]], []).append(
            (start, name_end, len(page) if end < 0 else end)
        )
    return lines


def _samples(page: bytes, lines: dict[str, list[_Span]], family: str) -> list[_Sample]:
    """Every sample of ``family`` on the page, in page order."""
    return [_parse_sample(page, *span) for span in lines.get(family, ())]


def _parse_sample(page: bytes, start: int, name_end: int, end: int) -> _Sample:
    """Parse the labels and value of the sample line ``page[start:end]`` whose name ends at
    ``name_end``."""
    pos = name_end
    if page[pos : pos + 1] == b"{":
        label_set = _LABEL_SET.match(page, pos, end)
        if label_set is None:
            raise _error(page, start, "malformed label set")
        pos = label_set.end()
    value = _VALUE.match(page, pos, end)
    if value is None:
        raise _error(page, start, "expected a value after the name and labels")
    try:
        number = float(value[1])
        if value[2] is not None:
            float(value[2])
    except ValueError:
        raise _error(page, start, "value or timestamp is not a number") from None
    return page[name_end:pos], number, start


def _queue_length(page: bytes, samples: list[_Sample]) -> int:
    """Sum of a queue gauge over its series (one per data-parallel engine)."""
    total = 0.0
    for value, start in _per_series(samples):
        if not (math.isfinite(value) and value >= 0):
            raise _error(page, start, "a queue length must be a finite number >= 0")
        total += value
    if not math.isfinite(total):
        raise _error(page, samples[0][2], "queue lengths add up to more than a float holds")
    return round(total)


def _mean_usage(page: bytes, family: str, samples: list[_Sample]) -> float:
    """Mean KV-cache usage over the series (engines), clamped to 0..1."""
    values = []
    for value, start in _per_series(samples):
        if not math.isfinite(value):
            raise _error(page, start, f"{family} must be a finite number")
        values.append(value)
    return min(1.0, max(0.0, sum(values) / len(values)))


def _per_series(samples: list[_Sample]) -> list[tuple[float, int]]:
    """One (value, line start) per distinct label set; a repeated series keeps its last line."""
    series = {labels: (value, start) for labels, value, start in samples}
    return list(series.values())


def _lora_state(
    page: bytes, samples: list[_Sample]
) -> tuple[tuple[str, ...], tuple[str, ...], int | None]:
    """Running adapters, waiting adapters and max_lora from the newest lora_requests_info series."""
    # NaN sorts as oldest; on a tie the first series on the page wins.
    label_set, _, start = max(samples, key=lambda s: -math.inf if math.isnan(s[1]) else s[1])
    labels = _labels(label_set)
    return (
        _adapter_list(_label(page, start, labels, b"running_lora_adapters")),
        _adapter_list(_label(page, start, labels, b"waiting_lora_adapters")),
        _int_label(page, start, labels, b"max_lora"),
    )


def _cache_config(page: bytes, samples: list[_Sample]) -> tuple[int | None, int | None]:
    """block_size and num_gpu_blocks from the first cache_config_info series."""
    label_set, _, start = samples[0]
    labels = _labels(label_set)
    return (
        _int_label(page, start, labels, b"block_size"),
        _int_label(page, start, labels, b"num_gpu_blocks"),
    )


def _labels(label_set: bytes) -> dict[bytes, bytes]:
    """Label name -> raw (still escaped) value of a label set that :data:`_LABEL_SET` matched."""
    return dict(_LABEL_PAIRS.findall(label_set))


def _adapter_list(text: str) -> tuple[str, ...]:
    """vLLM joins adapter names with ``,``; an empty label is an empty list."""
    return tuple(name for name in (part.strip() for part in text.split(",")) if name)


def _int_label(page: bytes, start: int, labels: dict[bytes, bytes], name: bytes) -> int | None:
    """An integer label; absent, empty or ``None`` (vLLM's str(None) before profiling) is None."""
    text = _label(page, start, labels, name).strip()
    if text in ("", "None"):
        return None
    try:
        return int(text)
    except ValueError:
        raise _error(page, start, f"label {name.decode()} is not an integer: {text!r}") from None


def _label(page: bytes, start: int, labels: dict[bytes, bytes], name: bytes) -> str:
    """The unescaped value of label ``name`` ("" when absent) of the line at ``start``."""
    try:
        text = labels.get(name, b"").decode()
    except UnicodeDecodeError:
        raise _error(page, start, f"label {name.decode()} is not UTF-8") from None
    if "\\" in text:
        text = _ESCAPE.sub(lambda m: _UNESCAPED.get(m[1], m[0]), text)
    return text


def _check_exposition(page: bytes) -> None:
    """Raise unless every line is blank, a comment or a well-formed sample."""
    if not page.strip():
        raise MetricsParseError("empty page")
    try:
        page.decode()
    except UnicodeDecodeError as exc:
        raise MetricsParseError(f"not UTF-8 text (byte {exc.start})") from None
    start = 0
    while start <= len(page):
        end = page.find(b"\n", start)
        if end < 0:
            end = len(page)
        line = page[start:end].strip()
        if line and not line.startswith(b"#"):
            name = _METRIC_NAME.match(page, start, end)
            if name is None:
                raise _error(page, start, "not a metric sample or comment")
            _parse_sample(page, start, name.end(), end)
        start = end + 1


def _error(page: bytes, start: int, message: str) -> MetricsParseError:
    """An error naming the line number and showing the start of the line at ``start``."""
    line_number = page.count(b"\n", 0, start) + 1
    end = page.find(b"\n", start)
    line = page[start : start + 80 if end < 0 else min(end, start + 80)]
    return MetricsParseError(f"line {line_number}: {message}: {line.decode(errors='replace')!r}")
