"""Seeded request streams: when each request arrives, how long its prompt and answer are, which
LoRA adapter it asks for, how critical it is, which system prompt it shares, and (multi-turn) which
conversation it continues.

A workload is data (:class:`Workload`); :func:`generate` turns it, a rate, a duration and a seed
into the list of requests a run plays. Arrival times and request contents come from separate
random streams, so request ``i`` has the same lengths, adapter and criticality at every rate:
curves over rates compare like with like.

Lengths are lognormal with the median and the mean of the public Azure LLM inference trace 2023
(conversation service: prompt median 1020 / mean 1155 tokens, output median 129 / mean 211), or
replayed from a trace CSV (``arrived_at, num_prefill_tokens, num_decode_tokens``, as processed by
microsoft/vidur; the raw Azure ``TIMESTAMP, ContextTokens, GeneratedTokens`` columns work too).
"""

from __future__ import annotations

import bisect
import csv
import itertools
import math
import random
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import msgspec

from scheduling_bench.prompts import prompt_ids, request_body
from scheduling_bench.recorded_trace import read_recorded_trace
from shared.errors import InputError
from shared.schemas import Criticality
from simulator.engine import RequestSpec, SyntheticPrompt

BASE_MODEL = "meta-llama/Llama-3.1-8B-Instruct"

# Seeds of SyntheticPrompt segments: system prompts are negative, request-own text is positive,
# so the two never produce equal token blocks; a multi-turn answer's text is far above both.
_OWN_TEXT_SEED = 1
_ANSWER_SEED = 1 << 40


class Workload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the requests of a run look like. Presets are in :data:`WORKLOADS`."""

    name: str
    description: str = ""
    burstiness: float = 1.0
    """Gamma shape of inter-arrival times: 1 is Poisson, below 1 burstier (as vLLM's bench)."""
    prompt_median: float = 1020.0
    prompt_sigma: float = 0.50
    """Lognormal sigma; 0.50 with median 1020 gives the trace's mean of 1155."""
    output_median: float = 129.0
    output_sigma: float = 0.99
    """Lognormal sigma; 0.99 with median 129 gives the trace's mean of 211 before the cap."""
    max_prompt: int = 16_000
    max_output: int = 1_000
    """Caps on drawn (or replayed) lengths; the conversation trace's longest answer is 1000."""
    trace: str | None = None
    """A trace CSV to replay (arrivals rescaled to the rate, lengths as recorded)."""
    adapters: int = 0
    """LoRA adapters requests spread over (0: every request asks for the base model)."""
    zipf: float = 1.0
    """Adapter popularity: adapter k (from 0) is asked with weight 1 / (k + 1) ** zipf."""
    max_loras: int = 4
    """GPU adapter slots per pod (vLLM ``--max-loras``)."""
    max_cpu_loras: int | None = None
    """CPU adapter cache per pod (vLLM ``--max-cpu-loras``); None: one per adapter."""
    prefix_groups: int = 0
    """Groups of requests that share a system prompt (0: no shared prefix)."""
    prefix_tokens: int = 0
    """Length of each group's system prompt, before the request's own prompt."""
    critical_fraction: float = 0.0
    sheddable_fraction: float = 0.0
    """Shares of Critical and Sheddable requests; the rest are Standard."""
    turns: int = 1
    """Requests per conversation. Above 1, each turn's prompt is the whole conversation so far
    (earlier messages and answers) plus a new user message of the drawn prompt length; the rate
    counts requests, so conversations start at ``rate / turns``."""
    think_time: float = 0.0
    """Mean seconds (exponential) between a turn's answer and the next turn's arrival."""
    chat: bool = True
    """Requests are chat completions (a message list); False: completions (one prompt text)."""
    recording: str | None = None
    """A flight recording (``lig record``) whose decisions are the arrivals: recorded times
    (rescaled to the rate), target models, criticalities and token sizes, played as recorded
    (no length caps; see ``scheduling_bench/recorded_trace.py``)."""
    recording_pool: str | None = None
    """The recorded pool to play (None: the recording's only pool with decision records)."""
    token_ids: bool = False
    """Completion prompts are sent as token ids (needs ``chat`` False), and the engines compute
    on those ids, so their KV-cache events carry them: what the precise prefix index
    (``lig bench --policies default+precise``) keys blocks by."""

    def validate(self) -> Workload:
        """Return self, or raise ValueError naming the first field that cannot work."""
        positive = ("burstiness", "prompt_median", "output_median", "max_prompt", "max_output",
                    "turns")
        for field in positive:
            if not getattr(self, field) > 0:
                raise ValueError(f"workload {self.name}: {field} must be > 0")
        for field in ("prompt_sigma", "output_sigma", "zipf", "prefix_groups", "prefix_tokens",
                      "think_time"):
            if getattr(self, field) < 0:
                raise ValueError(f"workload {self.name}: {field} must be >= 0")
        if self.adapters < 0 or self.max_loras < 1:
            raise ValueError(f"workload {self.name}: adapters must be >= 0, max_loras >= 1")
        if self.token_ids and self.chat:
            raise ValueError(f"workload {self.name}: token_ids needs chat false (token ids are "
                             "a completion prompt)")
        if (self.prefix_groups > 0) != (self.prefix_tokens > 0):
            raise ValueError(f"workload {self.name}: set both prefix_groups and prefix_tokens")
        if self.recording is not None and (self.trace is not None or self.turns > 1
                                           or self.prefix_groups):
            raise ValueError(f"workload {self.name}: a recording's arrivals are the requests: "
                             "no trace, turns or shared prefixes with it")
        shares = (self.critical_fraction, self.sheddable_fraction)
        if min(shares) < 0 or sum(shares) > 1:
            raise ValueError(
                f"workload {self.name}: critical_fraction and sheddable_fraction must be >= 0 "
                "and add up to at most 1"
            )
        return self


WORKLOADS: dict[str, Workload] = {
    "chat": Workload(
        name="chat",
        description="synthetic chat: lognormal lengths fitted to the Azure conversation trace, "
        "Poisson arrivals",
    ),
    "trace": Workload(
        name="trace",
        description="replay of a trace CSV (the Azure conversation trace), rescaled to the rate, "
        "as completion requests",
        chat=False,
    ),
    "multi-lora": Workload(
        name="multi-lora",
        description="chat lengths over 16 LoRA adapters with Zipf(1) popularity, 4 slots per pod",
        adapters=16,
    ),
    "shared-prefix": Workload(
        name="shared-prefix",
        description="chat prompts after one of 32 shared 2,000-token system prompts",
        prefix_groups=32,
        prefix_tokens=2_000,
    ),
    "mixed-criticality": Workload(
        name="mixed-criticality",
        description="chat with 20% Critical, 50% Standard and 30% Sheddable requests",
        critical_fraction=0.2,
        sheddable_fraction=0.3,
    ),
    "multi-turn": Workload(
        name="multi-turn",
        description="conversations of 6 turns: each prompt is the conversation so far plus a "
        "new message (median 300 tokens), the next turn 5 s (mean) after the answer",
        prompt_median=300.0,
        turns=6,
        think_time=5.0,
    ),
}


class BenchRequest(msgspec.Struct, frozen=True):
    """One request of a run: when it arrives, what the engine computes, what the client sends.

    The picker reads the request as a client sends it: an OpenAI body for ``model`` whose prompt
    is ``spec.prompt``'s text (:meth:`body`), and the InferenceObjective header naming its
    criticality. ``spec.adapter`` is the adapter the body asks for; the fleet submits the
    picker's resolved target instead.
    """

    time: float
    """Arrival (seconds from the start); for a follow-up turn, NaN (it comes ``think`` seconds
    after the answer to request ``after``)."""
    spec: RequestSpec
    model: str
    criticality: Criticality
    roles: tuple[str, ...] | None = None
    """The role of each prompt segment's message (chat); None: a completion request."""
    after: int = -1
    """Index of the turn this one follows (-1: it arrives at ``time``)."""
    think: float = 0.0
    then: int = -1
    """Index of the next turn of the conversation (-1: none)."""
    token_ids: bool = False
    """The client sends the prompt as token ids (:func:`prompt_ids` of ``spec.prompt``), and the
    engine computes on them (:meth:`engine_spec`)."""

    def body(self) -> bytes:
        """The JSON body the client sends."""
        prompt = self.spec.prompt
        if not isinstance(prompt, SyntheticPrompt):  # the bench generates synthetic text only
            raise TypeError("a bench request's prompt is synthetic text, not token ids")
        sent = prompt_ids(prompt) if self.token_ids else prompt
        return request_body(self.model, sent, self.roles, self.spec.max_tokens)

    def engine_spec(self, adapter: str | None) -> RequestSpec:
        """What the engine computes for this request on ``adapter`` (the picker's target): the
        synthetic prompt, or its token ids when the client sent ids (made when submitted: the
        generated request list stays small)."""
        spec = self.spec
        if self.token_ids:
            assert isinstance(spec.prompt, SyntheticPrompt)
            return msgspec.structs.replace(spec, prompt=prompt_ids(spec.prompt), adapter=adapter)
        if spec.adapter != adapter:
            return msgspec.structs.replace(spec, adapter=adapter)
        return spec

    @property
    def objective(self) -> str:
        """The InferenceObjective header value naming this request's criticality."""
        return OBJECTIVES[self.criticality]


OBJECTIVES: dict[Criticality, str] = {
    criticality: criticality.value.lower() for criticality in Criticality
}
"""The InferenceObjective names the benchmark's pool defines, one per criticality."""


class TraceRow(msgspec.Struct, frozen=True):
    """One request of a trace: arrival (seconds from the trace's start) and token counts."""

    arrived_at: float
    prompt_tokens: int
    output_tokens: int


class TraceError(InputError, ValueError):
    """A trace file that cannot be read; the message names the file and line."""


_VIDUR_COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def read_trace(path: str | Path) -> list[TraceRow]:
    """Read a trace CSV, sorted by arrival, times from 0; :class:`TraceError` if unusable.

    Token counts below 1 are raised to 1 (the engine needs at least one of each).
    """
    path = Path(path)
    try:
        with path.open(newline="") as handle:
            reader = csv.DictReader(handle)
            columns = tuple(reader.fieldnames or ())
            if set(_VIDUR_COLUMNS) <= set(columns):
                time_col, prompt_col, output_col = _VIDUR_COLUMNS
            elif set(_AZURE_COLUMNS) <= set(columns):
                time_col, prompt_col, output_col = _AZURE_COLUMNS
            else:
                raise TraceError(
                    f"{path}: expected columns {', '.join(_VIDUR_COLUMNS)} "
                    f"(or {', '.join(_AZURE_COLUMNS)}), found {', '.join(columns) or 'none'}"
                )
            rows = []
            for line, record in enumerate(reader, start=2):
                try:
                    rows.append(
                        TraceRow(
                            arrived_at=_seconds(record[time_col]),
                            prompt_tokens=max(1, int(record[prompt_col])),
                            output_tokens=max(1, int(record[output_col])),
                        )
                    )
                except (TypeError, ValueError) as error:
                    raise TraceError(f"{path}:{line}: {error}") from None
    except OSError as error:
        raise TraceError(f"{path}: {error.strerror or error}") from None
    if len(rows) < 2:
        raise TraceError(f"{path}: needs at least two requests to define a rate")
    rows.sort(key=lambda row: row.arrived_at)
    start = rows[0].arrived_at
    if rows[-1].arrived_at <= start:
        raise TraceError(f"{path}: every request arrives at the same time")
    return [msgspec.structs.replace(row, arrived_at=row.arrived_at - start) for row in rows]


def _seconds(value: str) -> float:
    """A float of seconds, or an Azure timestamp (``2023-11-16 18:15:46.6805900``) in seconds."""
    try:
        return float(value)
    except ValueError:
        pass
    head, _, fraction = value.strip().partition(".")
    # Azure writes 7 fractional digits, more than datetime parses; keep microseconds.
    stamp = datetime.fromisoformat(f"{head}.{fraction[:6]}" if fraction else head)
    return stamp.timestamp()


def generate(workload: Workload, rate: float, duration: float, seed: int) -> list[BenchRequest]:
    """The requests arriving in ``[0, duration)`` at ``rate`` requests/s on average."""
    workload.validate()
    if rate <= 0 or duration <= 0:
        raise ValueError("rate and duration must be > 0")
    if workload.recording is not None:
        return _recorded(workload, workload.recording, rate, duration)
    arrival_rng = random.Random(f"arrivals/{seed}")
    content_rng = random.Random(f"content/{seed}")
    if workload.trace is None:
        times: Iterator[float] = _gamma_arrivals(arrival_rng, rate, workload.burstiness)
        lengths: Iterator[tuple[int, int]] = _lognormal_lengths(content_rng, workload)
    else:
        rows = read_trace(workload.trace)
        times = _rescaled_arrivals(rows, rate)
        lengths = _replayed_lengths(rows, workload)
    adapters = adapter_names(workload.adapters)
    cumulative = list(
        itertools.accumulate(1.0 / (k + 1) ** workload.zipf for k in range(len(adapters)))
    )
    if workload.turns > 1:
        return _conversations(workload, times, lengths, content_rng, adapters, cumulative,
                              rate, duration)
    requests = []
    for index, (time, (prompt, output)) in enumerate(zip(times, lengths, strict=False)):
        if time >= duration:
            break
        adapter, criticality, system = _draws(workload, content_rng, adapters, cumulative)
        segments: tuple[tuple[int, int], ...] = ((_OWN_TEXT_SEED + index, prompt),)
        roles: tuple[str, ...] = ("user",)
        if system is not None:
            segments, roles = (system, *segments), ("system", *roles)
        requests.append(_request(workload, time, f"r{index}", segments, roles, output, adapter,
                                 criticality))
    return requests


def _recorded(workload: Workload, recording: str, rate: float,
              duration: float) -> list[BenchRequest]:
    """The recording's arrivals in ``[0, duration)``, their times scaled from the recorded rate
    to ``rate``. A recorded LoRA target plays as the simulated adapter of the same popularity
    rank (``adapter-0`` the most requested); any other target as the base model."""
    trace = read_recorded_trace(recording, workload.recording_pool)
    if workload.adapters < len(trace.adapters):
        raise ValueError(f"workload {workload.name}: the recording asks for "
                         f"{len(trace.adapters)} adapters, the pods have {workload.adapters}")
    simulated = dict(zip(trace.adapters, adapter_names(len(trace.adapters)), strict=True))
    scale = trace.rate / rate  # run seconds per recorded second
    requests = []
    for index, arrival in enumerate(trace.arrivals):
        time = arrival.time * scale
        if time >= duration:
            break
        requests.append(_request(
            workload, time, f"r{index}", ((_OWN_TEXT_SEED + index, arrival.prompt_tokens),),
            ("user",), arrival.output_tokens, simulated.get(arrival.target_model),
            arrival.criticality))
    return requests


def _request(workload: Workload, time: float, request_id: str,
             segments: tuple[tuple[int, int], ...], roles: tuple[str, ...], output: int,
             adapter: str | None, criticality: Criticality, after: int = -1,
             think: float = 0.0) -> BenchRequest:
    """One request of ``workload``: its prompt segments (with their chat roles), answer length,
    adapter and criticality; ``after``/``think`` place a conversation's later turn."""
    return BenchRequest(
        time=time,
        spec=RequestSpec(request_id=request_id, prompt=SyntheticPrompt(segments),
                         max_tokens=output, adapter=adapter),
        model=adapter or BASE_MODEL,
        criticality=criticality,
        roles=roles if workload.chat else None,
        after=after,
        think=think,
        token_ids=workload.token_ids,
    )


def _draws(workload: Workload, rng: random.Random, adapters: tuple[str, ...],
           cumulative: list[float]) -> tuple[str | None, Criticality, tuple[int, int] | None]:
    """A request's adapter, criticality and shared system prompt segment.

    Every choice is drawn for every request, so that a workload's options do not shift the random
    stream of the others.
    """
    adapter_draw, class_draw, group_draw = (rng.random() for _ in range(3))
    adapter = None
    if adapters:
        adapter = adapters[bisect.bisect_right(cumulative, adapter_draw * cumulative[-1])]
    system = None
    if workload.prefix_groups:
        group = int(group_draw * workload.prefix_groups)
        system = (-1 - group, workload.prefix_tokens)
    return adapter, _criticality(workload, class_draw), system


def _conversations(workload: Workload, times: Iterator[float],
                   lengths: Iterator[tuple[int, int]], rng: random.Random,
                   adapters: tuple[str, ...], cumulative: list[float], rate: float,
                   duration: float) -> list[BenchRequest]:
    """Multi-turn requests: conversations start at ``rate / turns`` (``times`` is drawn at
    ``rate``, so every ``turns``-th arrival starts one); each turn's prompt is the conversation so
    far (answers as segments of their own seed) plus a new user message, capped at
    ``max_prompt`` tokens by ending the conversation early."""
    requests: list[BenchRequest] = []
    turns = workload.turns
    for conversation, time in enumerate(itertools.islice(times, turns - 1, None, turns)):
        if time >= duration:
            break
        adapter, criticality, system = _draws(workload, rng, adapters, cumulative)
        segments: tuple[tuple[int, int], ...] = () if system is None else (system,)
        roles: tuple[str, ...] = () if system is None else ("system",)
        for turn in range(turns):
            prompt, output = next(lengths)
            index = len(requests)
            segments = (*segments, (_OWN_TEXT_SEED + index, prompt))
            roles = (*roles, "user")
            if sum(length for _, length in segments) > workload.max_prompt:
                break
            think = rng.expovariate(1.0 / workload.think_time) if workload.think_time else 0.0
            if turn:
                requests[-1] = msgspec.structs.replace(requests[-1], then=index)
            requests.append(_request(
                workload, time if turn == 0 else math.nan, f"c{conversation}t{turn}", segments,
                roles, output, adapter, criticality, after=index - 1 if turn else -1,
                think=think))
            segments = (*segments, (_ANSWER_SEED + index, output))
            roles = (*roles, "assistant")
    return requests


def adapter_names(count: int) -> tuple[str, ...]:
    """The names of a workload's adapters, most popular first."""
    return tuple(f"adapter-{k}" for k in range(count))


def _criticality(workload: Workload, draw: float) -> Criticality:
    if draw < workload.critical_fraction:
        return Criticality.CRITICAL
    if draw < workload.critical_fraction + workload.sheddable_fraction:
        return Criticality.SHEDDABLE
    return Criticality.STANDARD


def _gamma_arrivals(rng: random.Random, rate: float, shape: float) -> Iterator[float]:
    """Arrival times with Gamma(shape) gaps of mean ``1 / rate`` (shape 1: Poisson)."""
    scale = 1.0 / (rate * shape)
    time = 0.0
    while True:
        time += rng.gammavariate(shape, scale)
        yield time


def _lognormal_lengths(rng: random.Random, workload: Workload) -> Iterator[tuple[int, int]]:
    prompt_mu, output_mu = math.log(workload.prompt_median), math.log(workload.output_median)
    while True:
        prompt = round(rng.lognormvariate(prompt_mu, workload.prompt_sigma))
        output = round(rng.lognormvariate(output_mu, workload.output_sigma))
        yield (
            min(max(prompt, 1), workload.max_prompt),
            min(max(output, 1), workload.max_output),
        )


def _rescaled_arrivals(rows: list[TraceRow], rate: float) -> Iterator[float]:
    """The trace's arrivals with time scaled to ``rate``, the trace looped when it runs out."""
    span = rows[-1].arrived_at
    scale = span / (len(rows) - 1) * rate  # trace seconds per run second
    # The loop restarts one mean gap after the last arrival, keeping the mean rate.
    period = (span + span / (len(rows) - 1)) / scale
    for lap in itertools.count():
        for row in rows:
            yield lap * period + row.arrived_at / scale


def _replayed_lengths(rows: list[TraceRow], workload: Workload) -> Iterator[tuple[int, int]]:
    for row in itertools.cycle(rows):
        yield (
            min(row.prompt_tokens, workload.max_prompt),
            min(row.output_tokens, workload.max_output),
        )
