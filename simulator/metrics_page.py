"""The ``/metrics`` page of one simulated pod, in vLLM's V1 format (default) or its V0 format.

The page is rendered here rather than through a prometheus_client registry so that many pods can
share one process and so that series behave as in vLLM: families, labels and histogram buckets
are vLLM's (``vllm/v1/metrics/loggers.py``), in Prometheus text format 0.0.4 as
prometheus_client writes it (a counter ``<name>_total``, its ``<name>_created`` samples in a
gauge family of their own).

- V1: labels ``model_name`` and ``engine="0"``; ``vllm:kv_cache_usage_perc``;
  ``vllm:prefix_cache_queries`` / ``_hits`` counters; ``vllm:inter_token_latency_seconds``.
- V0: label ``model_name`` only; ``vllm:gpu_cache_usage_perc`` and the other V0 gauges.
- Both: ``vllm:cache_config_info`` (a gauge at 1 whose labels carry the cache config) and, when
  the server has LoRA adapters, ``vllm:lora_requests_info``: a gauge with labels ``max_lora``,
  ``running_lora_adapters`` and ``waiting_lora_adapters`` (comma-separated, sorted here), set to
  the unix time of the last step that saw that combination. As in vLLM, every combination ever
  seen stays on the page; the newest value is the current state.

State gauges (running, waiting, KV usage) are read from the engine at render time; everything
else is recorded per step by ``record_step``. Latencies are in simulated seconds.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence

from prometheus_client.utils import floatToGoString

from simulator.engine import EngineConfig, EngineSnapshot, Request, StepResult

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort")
FORMATS = ("v1", "v0")


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class Histogram:
    """Bucket counts, sum and count of observations."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Add one observation."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1


class MetricsPage:
    """Counters and histograms of one pod, and their rendering."""

    def __init__(
        self, config: EngineConfig, fmt: str = "v1", wall: Callable[[], float] = time.time
    ) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"metrics format must be one of {FORMATS}, not {fmt!r}")
        self.config = config
        self.format = fmt
        self._wall = wall
        self._created = wall()
        self._labels = _labels(
            {"model_name": config.model} | ({"engine": "0"} if fmt == "v1" else {})
        )
        self.counters: dict[str, float] = dict.fromkeys(
            ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
             "generation_tokens"),
            0,
        )
        self.request_success: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        token_buckets = one_two_five_buckets(config.profile.max_model_len)
        self.histograms: dict[str, tuple[str, Histogram]] = {
            "vllm:time_to_first_token_seconds": (
                "Histogram of time to first token in seconds.", Histogram(TTFT_BUCKETS)),
            "vllm:time_per_output_token_seconds": (
                "Histogram of time per output token in seconds.",
                Histogram(TOKEN_LATENCY_BUCKETS)),
            "vllm:inter_token_latency_seconds": (
                "Histogram of inter-token latency in seconds.", Histogram(TOKEN_LATENCY_BUCKETS)),
            "vllm:e2e_request_latency_seconds": (
                "Histogram of e2e request latency in seconds.",
                Histogram(REQUEST_LATENCY_BUCKETS)),
            "vllm:request_queue_time_seconds": (
                "Histogram of time spent in WAITING phase for request.",
                Histogram(REQUEST_LATENCY_BUCKETS)),
            "vllm:request_inference_time_seconds": (
                "Histogram of time spent in RUNNING phase for request.",
                Histogram(REQUEST_LATENCY_BUCKETS)),
            "vllm:request_prefill_time_seconds": (
                "Histogram of time spent in PREFILL phase for request.",
                Histogram(REQUEST_LATENCY_BUCKETS)),
            "vllm:request_decode_time_seconds": (
                "Histogram of time spent in DECODE phase for request.",
                Histogram(REQUEST_LATENCY_BUCKETS)),
            "vllm:request_prompt_tokens": (
                "Number of prefill tokens processed.", Histogram(token_buckets)),
            "vllm:request_generation_tokens": (
                "Number of generation tokens processed.", Histogram(token_buckets)),
            "vllm:iteration_tokens_total": (
                "Histogram of number of tokens per engine_step.",
                Histogram(ITERATION_TOKEN_BUCKETS)),
            "vllm:request_max_num_generation_tokens": (
                "Histogram of maximum number of requested generation tokens.",
                Histogram(token_buckets)),
            "vllm:request_params_n": (
                "Histogram of the n request parameter.", Histogram(N_BUCKETS)),
            "vllm:request_params_max_tokens": (
                "Histogram of the max_tokens request parameter.", Histogram(token_buckets)),
        }
        if fmt == "v0":
            del self.histograms["vllm:inter_token_latency_seconds"]
        self._lora_series: dict[tuple[str, str], float] = {}

    def histogram(self, name: str) -> Histogram:
        """The histogram of family ``name`` (e.g. ``vllm:time_to_first_token_seconds``)."""
        return self.histograms[name][1]

    def record_step(self, result: StepResult, snapshot: EngineSnapshot | None = None) -> None:
        """Account one finished step; ``snapshot`` (state after it) feeds the LoRA gauge."""
        counters = self.counters
        counters["num_preemptions"] += result.plan.preempted
        counters["prompt_tokens"] += result.prompt_tokens
        counters["generation_tokens"] += len(result.emitted)
        counters["prefix_cache_queries"] += result.prefix_cache_queries
        counters["prefix_cache_hits"] += result.prefix_cache_hits
        self.histogram("vllm:iteration_tokens_total").observe(
            result.prompt_tokens + len(result.emitted)
        )
        ttft = self.histogram("vllm:time_to_first_token_seconds")
        per_token = [self.histogram("vllm:time_per_output_token_seconds")]
        if self.format == "v1":
            per_token.append(self.histogram("vllm:inter_token_latency_seconds"))
        now = result.time
        for request in result.emitted:
            if request.num_output == 1:
                ttft.observe(now - request.arrival_time)
            else:
                for histogram in per_token:
                    histogram.observe(request.last_gap)
        for request in result.finished:
            self._record_finished(request)
        if snapshot is not None and snapshot.max_lora:
            key = (",".join(sorted(snapshot.running_adapters)),
                   ",".join(sorted(snapshot.waiting_adapters)))
            self._lora_series.pop(key, None)  # re-insert so the newest renders last
            self._lora_series[key] = self._wall()

    def _record_finished(self, request: Request) -> None:
        reason = request.finish_reason or "abort"
        self.request_success[reason] = self.request_success.get(reason, 0) + 1
        if reason == "abort" or request.first_token_time is None:
            return
        arrived = request.arrival_time
        scheduled = request.first_scheduled_time
        first = request.first_token_time
        finished = request.finish_time
        assert scheduled is not None and finished is not None  # it emitted tokens
        observe = self.histogram
        observe("vllm:e2e_request_latency_seconds").observe(finished - arrived)
        observe("vllm:request_queue_time_seconds").observe(scheduled - arrived)
        observe("vllm:request_prefill_time_seconds").observe(first - scheduled)
        observe("vllm:request_decode_time_seconds").observe(finished - first)
        observe("vllm:request_inference_time_seconds").observe(finished - scheduled)
        observe("vllm:request_prompt_tokens").observe(request.num_prompt_tokens)
        observe("vllm:request_generation_tokens").observe(request.num_output)
        observe("vllm:request_max_num_generation_tokens").observe(request.max_tokens)
        observe("vllm:request_params_n").observe(1)
        observe("vllm:request_params_max_tokens").observe(request.max_tokens)

    def render(self, snapshot: EngineSnapshot) -> bytes:
        """The whole page for the engine state ``snapshot``."""
        out: list[str] = []
        labels = self._labels
        created = floatToGoString(self._created)
        v1 = self.format == "v1"

        def gauge(name: str, doc: str, value: float) -> None:
            out.append(f"# HELP {name} {doc}\n# TYPE {name} gauge\n")
            out.append(f"{name}{{{labels}}} {floatToGoString(value)}\n")

        def counter(name: str, doc: str, value: float) -> None:
            out.append(f"# HELP {name}_total {doc}\n# TYPE {name}_total counter\n")
            out.append(f"{name}_total{{{labels}}} {floatToGoString(value)}\n")
            _render_created(out, name, doc, [labels], created)

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              snapshot.running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
              snapshot.waiting)
        queries = self.counters["prefix_cache_queries"]
        hits = self.counters["prefix_cache_hits"]
        if v1:
            gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                  snapshot.kv_cache_usage)
            counter("vllm:prefix_cache_queries",
                    "Prefix cache queries, in terms of number of queried tokens.", queries)
            counter("vllm:prefix_cache_hits",
                    "Prefix cache hits, in terms of number of cached tokens.", hits)
        else:
            gauge("vllm:num_requests_swapped", "Number of requests swapped to CPU.", 0)
            gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.",
                  snapshot.kv_cache_usage)
            gauge("vllm:cpu_cache_usage_perc", "CPU KV-cache usage. 1 means 100 percent usage.",
                  0)
            gauge("vllm:gpu_prefix_cache_hit_rate", "GPU prefix cache block hit rate.",
                  hits / queries if queries else 0.0)
            gauge("vllm:cpu_prefix_cache_hit_rate", "CPU prefix cache block hit rate.", 0.0)
        counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                self.counters["num_preemptions"])
        counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                self.counters["prompt_tokens"])
        counter("vllm:generation_tokens", "Number of generation tokens processed.",
                self.counters["generation_tokens"])
        name, doc = "vllm:request_success", "Count of successfully processed requests."
        out.append(f"# HELP {name}_total {doc}\n# TYPE {name}_total counter\n")
        series = [f'{labels},finished_reason="{reason}"' for reason in self.request_success]
        for label_set, value in zip(series, self.request_success.values(), strict=True):
            out.append(f"{name}_total{{{label_set}}} {floatToGoString(value)}\n")
        _render_created(out, name, doc, series, created)
        for name, (doc, histogram) in self.histograms.items():
            _render_histogram(out, name, doc, histogram, labels, created)
        self._render_info(out, snapshot)
        return "".join(out).encode()

    def _render_info(self, out: list[str], snapshot: EngineSnapshot) -> None:
        profile = self.config.profile
        info = {
            "block_size": str(profile.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(self.config.enable_prefix_caching),
            "gpu_memory_utilization": "0.9",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(profile.num_gpu_blocks),
            "num_gpu_blocks_override": "None",
            "sliding_window": "None",
            "swap_space": "4",
        }
        if self.format == "v1":
            info["engine"] = "0"
        name = "vllm:cache_config_info"
        out.append(f"# HELP {name} Information of the LLMEngine CacheConfig\n")
        out.append(f"# TYPE {name} gauge\n{name}{{{_labels(info)}}} 1.0\n")
        if not snapshot.max_lora:
            return
        name = "vllm:lora_requests_info"
        out.append(f"# HELP {name} Running stats on lora requests.\n# TYPE {name} gauge\n")
        max_lora = str(snapshot.max_lora)
        for (running, waiting), stamp in self._lora_series.items():
            series = _labels(
                {"max_lora": max_lora, "waiting_lora_adapters": waiting,
                 "running_lora_adapters": running}
            )
            out.append(f"{name}{{{series}}} {floatToGoString(stamp)}\n")


def _render_histogram(
    out: list[str], name: str, doc: str, histogram: Histogram, labels: str, created: str
) -> None:
    out.append(f"# HELP {name} {doc}\n# TYPE {name} histogram\n")
    cumulative = 0
    for bound, count in zip(histogram.bounds, histogram.counts, strict=False):
        cumulative += count
        out.append(f'{name}_bucket{{{labels},le="{floatToGoString(bound)}"}} {cumulative}.0\n')
    out.append(f'{name}_bucket{{{labels},le="+Inf"}} {histogram.count}.0\n')
    out.append(f"{name}_count{{{labels}}} {histogram.count}.0\n")
    out.append(f"{name}_sum{{{labels}}} {floatToGoString(histogram.total)}\n")
    _render_created(out, name, doc, [labels], created)


def _render_created(
    out: list[str], name: str, doc: str, label_sets: list[str], created: str
) -> None:
    """The ``_created`` samples, as prometheus_client writes them: a gauge family of their own."""
    out.append(f"# HELP {name}_created {doc}\n# TYPE {name}_created gauge\n")
    out.extend(f"{name}_created{{{label_set}}} {created}\n" for label_set in label_sets)


def _labels(values: dict[str, str]) -> str:
    return ",".join(f'{key}="{_escape(value)}"' for key, value in values.items())


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
