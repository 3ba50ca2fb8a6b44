"""What the engine reports to its drivers: a step's plan and result, its cumulative counters, and
a snapshot of the state a gateway reads from a pod's metrics."""

from __future__ import annotations

import msgspec

from simulator.lora import AdapterLoad
from simulator.request import Request


class StepPlan(msgspec.Struct, frozen=True):
    """The batch of one step, decided at its start."""

    start: float
    end: float
    num_requests: int
    prefill_tokens: int
    decode_tokens: int
    context_tokens: int
    adapters: frozenset[str]
    adapter_load: AdapterLoad
    preempted: int

    @property
    def duration(self) -> float:
        """Seconds the step takes."""
        return self.end - self.start


class StepResult:
    """What one finished step produced: one token for each request in ``emitted``."""

    __slots__ = (
        "emitted",
        "finished",
        "plan",
        "prefix_cache_hits",
        "prefix_cache_queries",
        "prompt_tokens",
        "time",
    )

    def __init__(self, plan: StepPlan, time: float, queries: int, hits: int) -> None:
        self.plan = plan
        self.time = time
        self.emitted: list[Request] = []
        """Requests that got a token at ``time`` (their ``num_output``-th)."""
        self.finished: list[Request] = []
        """Requests that completed or were aborted in this step."""
        self.prompt_tokens = 0
        """Prompt tokens of requests that emitted their first token (vLLM counts them then)."""
        self.prefix_cache_queries = queries
        self.prefix_cache_hits = hits


class EngineCounters(msgspec.Struct):
    """Cumulative counts since the engine started."""

    steps: int = 0
    busy_time: float = 0.0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    adapter_loads: int = 0
    adapter_disk_loads: int = 0
    finished: int = 0
    aborted: int = 0


class EngineSnapshot(msgspec.Struct, frozen=True):
    """The state a gateway reads from a pod's metrics (field names as in ``PodMetrics``)."""

    time: float
    waiting: int
    running: int
    kv_cache_usage: float
    running_adapters: frozenset[str]
    waiting_adapters: frozenset[str]
    max_lora: int
    """``max_loras`` when the server has adapters, else 0 (vLLM then omits the LoRA metric)."""
    block_size: int
    num_gpu_blocks: int
