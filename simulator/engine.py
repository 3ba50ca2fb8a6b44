"""The simulated vLLM engine: V1's scheduler loop, one step at a time, with an injected clock.

Pure logic: no I/O, no sleeping, no global state. Time comes from ``clock.now()`` and randomness
(step-time jitter only) from the ``random.Random`` passed in, so the same arrivals give the same
results whether a real-time or a virtual-time driver runs the engine.

API::

    engine = Engine(config, clock, rng)
    request = engine.submit(RequestSpec("r1", prompt=(1, 2, 3), max_tokens=8))  # queued at now()
    plan = engine.begin_step()      # schedule a batch at now(); None when there is nothing to do
    ...                             # the driver moves its clock to plan.end
    result = engine.finish_step()   # one token for every request that caught up, stamped now()
    engine.snapshot()               # what the gateway's picker would see (EngineSnapshot)
    engine.counters                 # cumulative counts (EngineCounters)
    engine.abort(request)           # drop a request (client went away)

A step follows vLLM V1's ``Scheduler.schedule``:

1. Running requests first, in order (FCFS): each gets ``num_tokens - num_computed`` tokens (1 for
   decoding, a chunk of its prompt while prefilling) out of the step's ``max_num_batched_tokens``
   budget. KV blocks are allocated as the context grows; when none are free the newest running
   request is preempted (its blocks freed, itself back at the front of the waiting queue, its
   tokens recomputed later) until the allocation fits.
2. Then, only if nobody was preempted, waiting requests in order while budget and
   ``max_num_seqs`` allow: a request whose adapter would make the batch exceed ``max_loras``
   distinct adapters is skipped (it keeps its place; others go ahead); a new request reuses the
   longest cached prefix of full blocks (at most ``num_tokens - 1`` tokens) and prefills the rest
   in chunks; a request whose blocks do not fit stops admission for this step.
3. The step lasts ``profile.step_time(prefill, decode, context)`` plus the time to load adapters
   that are not resident (see ``lora``), times ``1 + N(0, jitter)``.
4. When it ends, every scheduled request whose computed tokens caught up with its tokens emits one
   token; a request with ``max_tokens`` tokens finishes and frees its blocks (they stay cached).

Token content: a prompt is either token ids (``tuple[int, ...]``, from ``tokenizer.encode``) or a
``SyntheticPrompt`` (runs of ``(seed, length)``: equal seeds mean equal tokens, so a benchmark can
model shared system prompts without materialising ids). Generated tokens are the spec's
``output`` ids when given, otherwise unique to the request. Full blocks are identified by a hash
chained over the previous block's hash, the adapter and the block's content.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import random
from collections import deque
from collections.abc import Callable
from typing import Protocol

import msgspec

from simulator.kv_cache import KVCache
from simulator.lora import NO_LOAD, AdapterLoad, AdapterSlots
from simulator.profiles import DEFAULT_PROFILE, PROFILES, Profile


class Clock(Protocol):
    """Where the engine reads the time, in simulated seconds."""

    def now(self) -> float: ...


class SyntheticPrompt(msgspec.Struct, frozen=True):
    """A prompt described by runs of ``(seed, length)`` tokens instead of token ids."""

    segments: tuple[tuple[int, int], ...]

    @property
    def length(self) -> int:
        """Number of tokens."""
        return sum(length for _, length in self.segments)


class RequestSpec(msgspec.Struct, frozen=True):
    """One request as submitted: what to compute, not how far it got."""

    request_id: str
    prompt: tuple[int, ...] | SyntheticPrompt
    max_tokens: int
    """Tokens to generate; the request finishes after exactly this many."""
    adapter: str | None = None
    output: tuple[int, ...] | None = None
    """Ids of the generated tokens (at least ``max_tokens``); None: unique to this request."""
    finish_reason: str = "length"
    """Reported when the request completes: "length" (hit max_tokens) or "stop" (EOS)."""


class EngineConfig(msgspec.Struct, frozen=True):
    """One simulated vLLM server: its model's profile and its scheduler settings."""

    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    profile: Profile = PROFILES[DEFAULT_PROFILE]
    adapters: tuple[str, ...] = ()
    """LoRA adapters the server knows (``--lora-modules``); others are rejected."""
    max_loras: int = 4
    max_cpu_loras: int | None = None
    """CPU cache size for adapters; None means ``max_loras`` (vLLM's default)."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    record_token_times: bool = False
    """Keep every token's time on its request (``Request.token_times``), for tests and traces."""


class RequestRejected(ValueError):
    """A request the server refuses (HTTP 400 in vLLM)."""


class UnknownAdapterError(RequestRejected):
    """The request names an adapter the server does not have (HTTP 404 in vLLM)."""


class Status(enum.IntEnum):
    """Where a request is in the engine."""

    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Request:
    """A submitted request and its progress; the engine mutates it, drivers read it."""

    __slots__ = (
        "_abort",
        "_ids",
        "_next_full",
        "_num_registered",
        "_room",
        "_segment_ends",
        "_segment_seeds",
        "adapter",
        "arrival_time",
        "block_hashes",
        "blocks",
        "finish_reason",
        "finish_time",
        "first_scheduled_time",
        "first_token_time",
        "last_gap",
        "last_token_time",
        "max_gap",
        "max_tokens",
        "num_cached_tokens",
        "num_computed",
        "num_output",
        "num_prompt_tokens",
        "num_tokens",
        "preemptions",
        "request_id",
        "serial",
        "spec",
        "status",
        "step_tokens",
        "token_times",
        "watcher",
    )

    def __init__(self, spec: RequestSpec, serial: int, arrival_time: float, num_prompt: int):
        self.spec = spec
        self.request_id = spec.request_id
        self.adapter = spec.adapter
        self.serial = serial
        self.arrival_time = arrival_time
        self.num_prompt_tokens = num_prompt
        self.max_tokens = spec.max_tokens
        self.num_tokens = num_prompt
        self.num_computed = 0
        self.num_output = 0
        self.blocks: list[int] = []
        self.block_hashes: list[int] = []
        self._num_registered = 0
        self._next_full = 0  # context length at which another block is full (to register)
        self._room = 0  # tokens the allocated blocks hold
        self.num_cached_tokens = -1
        self.preemptions = 0
        self.status = Status.WAITING
        self.step_tokens = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time = 0.0
        self.last_gap = 0.0
        self.max_gap = 0.0
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.token_times: list[float] | None = None
        self.watcher: Callable[[], None] | None = None
        """Called by real-time drivers after each token and at the end."""
        self._abort = False
        prompt = spec.prompt
        self._ids = prompt if isinstance(prompt, tuple) else None
        segments = () if isinstance(prompt, tuple) else prompt.segments
        self._segment_ends = list(itertools.accumulate(length for _, length in segments))
        self._segment_seeds = [seed for seed, _ in segments]

    @property
    def finished(self) -> bool:
        """True once the request completed or was aborted."""
        return self.status is Status.FINISHED


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


class Engine:
    """One simulated vLLM engine core: scheduler, KV cache, adapters and step timing."""

    def __init__(self, config: EngineConfig, clock: Clock, rng: random.Random) -> None:
        profile = config.profile.validate()
        if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.config = config
        self.profile = profile
        self.clock = clock
        self.rng = rng
        self.kv = KVCache(profile.num_gpu_blocks, profile.block_size, config.enable_prefix_caching)
        self.adapter_slots = AdapterSlots(
            config.max_loras,
            config.max_cpu_loras or config.max_loras,
            profile.lora_load_cpu_s,
            profile.lora_load_disk_s,
        )
        self.counters = EngineCounters()
        self._known_adapters = frozenset(config.adapters)
        self._adapter_keys = {name: index + 1 for index, name in enumerate(config.adapters)}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._running_adapters: dict[str, int] = {}
        self._waiting_adapters: dict[str, int] = {}
        self._serial = 0
        self._batch: list[Request] | None = None
        self._plan: StepPlan | None = None
        self._step_queries = 0
        self._step_hits = 0
        self._aborting: list[Request] = []

    # ---- state -------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue (new and preempted)."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks in the running batch."""
        return len(self._running)

    @property
    def has_work(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._waiting or self._running)

    @property
    def in_flight(self) -> StepPlan | None:
        """The step begun and not yet finished, if any."""
        return self._plan

    def snapshot(self) -> EngineSnapshot:
        """Queue lengths, KV usage and adapters as the pod's metrics would show them now."""
        return EngineSnapshot(
            time=self.clock.now(),
            waiting=len(self._waiting),
            running=len(self._running),
            kv_cache_usage=self.kv.usage,
            running_adapters=frozenset(self._running_adapters),
            waiting_adapters=frozenset(self._waiting_adapters),
            max_lora=self.config.max_loras if self.config.adapters else 0,
            block_size=self.profile.block_size,
            num_gpu_blocks=self.profile.num_gpu_blocks,
        )

    # ---- requests ----------------------------------------------------------------------------

    def validate(self, spec: RequestSpec) -> int:
        """The prompt length of ``spec``, or raise ``RequestRejected`` saying why it cannot run."""
        if spec.adapter is not None and spec.adapter not in self._known_adapters:
            raise UnknownAdapterError(f"The model `{spec.adapter}` does not exist.")
        prompt = spec.prompt
        num_prompt = len(prompt) if isinstance(prompt, tuple) else prompt.length
        if num_prompt < 1:
            raise RequestRejected("The prompt is empty.")
        if spec.max_tokens < 1:
            raise RequestRejected("max_tokens must be at least 1.")
        if spec.output is not None and len(spec.output) < spec.max_tokens:
            raise RequestRejected("output holds fewer ids than max_tokens.")
        total = num_prompt + spec.max_tokens
        max_len = self.profile.max_model_len
        if total > max_len:
            raise RequestRejected(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {total} tokens ({num_prompt} in the messages, {spec.max_tokens} in "
                "the completion). Please reduce the length of the messages or completion."
            )
        block_size = self.profile.block_size
        if -(-total // block_size) > self.profile.num_gpu_blocks:
            raise RequestRejected(
                f"The request needs {total} tokens of KV cache; the server has room for "
                f"{self.profile.num_gpu_blocks * block_size}."
            )
        return num_prompt

    def submit(self, spec: RequestSpec) -> Request:
        """Queue ``spec`` at ``clock.now()``; raises ``RequestRejected`` when it cannot run."""
        num_prompt = self.validate(spec)
        self._serial += 1
        request = Request(spec, self._serial, self.clock.now(), num_prompt)
        if self.config.record_token_times:
            request.token_times = []
        self._waiting.append(request)
        if request.adapter is not None:
            _count_in(self._waiting_adapters, request.adapter)
        return request

    def abort(self, request: Request) -> None:
        """Drop ``request``: now if it is not in the step in flight, else when that step ends."""
        if request.status is Status.FINISHED:
            return
        if request.status is Status.WAITING:
            self._waiting.remove(request)
            if request.adapter is not None:
                _count_out(self._waiting_adapters, request.adapter)
            self._finish(request, "abort", self.clock.now())
            return
        if self._batch is not None and request in self._batch:
            request._abort = True
            request.step_tokens = 0  # so that the step's end computes nothing for it
            self._aborting.append(request)
            return
        self._running.remove(request)
        self._release_running(request)
        self._finish(request, "abort", self.clock.now())

    # ---- steps -------------------------------------------------------------------------------

    def begin_step(self) -> StepPlan | None:
        """Schedule a batch at ``clock.now()`` as vLLM V1 does; None if nothing can run."""
        if self._plan is not None:
            raise RuntimeError("begin_step called while a step is in flight")
        if not self._waiting and not self._running:
            return None
        now = self.clock.now()
        config = self.config
        block_size = self.profile.block_size
        kv = self.kv
        running = self._running
        budget = config.max_num_batched_tokens
        batch: list[Request] = []
        add = batch.append
        prefill = decode = context = 0
        preempted = 0

        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            computed = request.num_computed
            tokens = request.num_tokens - computed
            if tokens > budget:
                tokens = budget
            total = computed + tokens
            if total > request._room:
                missing = -(-total // block_size) - len(request.blocks)
                new_blocks = kv.allocate(missing)
                while new_blocks is None:
                    victim = running.pop()
                    self._preempt(victim)
                    preempted += 1
                    if victim is request:
                        break
                    new_blocks = kv.allocate(missing)
                if new_blocks is None:
                    break
                request.blocks.extend(new_blocks)
                request._room = len(request.blocks) * block_size
            if total >= request._next_full:
                self._register_full_blocks(request, total // block_size)
            request.step_tokens = tokens
            add(request)
            budget -= tokens
            if tokens == 1 and request.num_output and total == request.num_tokens:
                decode += 1
            else:
                prefill += tokens
            context += total
            index += 1

        queries = hits = 0
        if not preempted and self._waiting:
            queries, hits, admitted_tokens, admitted_context = self._admit(now, budget, batch)
            prefill += admitted_tokens
            context += admitted_context
        self.counters.preemptions += preempted
        if not batch:
            return None

        adapters: frozenset[str] = frozenset()
        load = NO_LOAD
        if self._known_adapters:
            adapters = frozenset(r.adapter for r in batch if r.adapter is not None)
            load = self.adapter_slots.activate(adapters)
        duration = self.profile.step_time(prefill, decode, context) + load.seconds
        jitter = self.profile.jitter
        if jitter:
            duration *= max(0.2, self.rng.gauss(1.0, jitter))
        plan = StepPlan(
            start=now,
            end=now + duration,
            num_requests=len(batch),
            prefill_tokens=prefill,
            decode_tokens=decode,
            context_tokens=context,
            adapters=adapters,
            adapter_load=load,
            preempted=preempted,
        )
        counters = self.counters
        counters.steps += 1
        counters.busy_time += duration
        counters.prefix_cache_queries += queries
        counters.prefix_cache_hits += hits
        counters.adapter_loads += load.from_cpu + load.from_disk
        counters.adapter_disk_loads += load.from_disk
        self._batch = batch
        self._plan = plan
        self._step_queries = queries
        self._step_hits = hits
        return plan

    def finish_step(self) -> StepResult:
        """End the step in flight at ``clock.now()``: emit tokens, finish completed requests."""
        plan, batch = self._plan, self._batch
        if plan is None or batch is None:
            raise RuntimeError("finish_step called with no step in flight")
        self._plan = None
        self._batch = None
        now = self.clock.now()
        result = StepResult(plan, now, self._step_queries, self._step_hits)
        emit = result.emitted.append
        done, self._aborting = self._aborting, []
        finish = done.append
        for request in batch:
            computed = request.num_computed + request.step_tokens
            request.num_computed = computed
            if computed < request.num_tokens:
                continue  # a prefill chunk short of the prompt's end, or an aborted request
            request.num_tokens += 1
            output = request.num_output + 1
            request.num_output = output
            if output == 1:
                request.first_token_time = now
                result.prompt_tokens += request.num_prompt_tokens
            else:
                gap = now - request.last_token_time
                request.last_gap = gap
                if gap > request.max_gap:
                    request.max_gap = gap
            request.last_token_time = now
            if request.token_times is not None:
                request.token_times.append(now)
            emit(request)
            if output >= request.max_tokens:
                finish(request)
        counters = self.counters
        counters.generation_tokens += len(result.emitted)
        counters.prompt_tokens += result.prompt_tokens
        if done:
            finished_ids = {id(request) for request in done}
            self._running = [r for r in self._running if id(r) not in finished_ids]
            for request in done:
                self._release_running(request)
                reason = "abort" if request._abort else request.spec.finish_reason
                self._finish(request, reason, now)
            result.finished = done
        return result

    # ---- internals ---------------------------------------------------------------------------

    def _admit(self, now: float, budget: int, batch: list[Request]) -> tuple[int, int, int, int]:
        """Move waiting requests into the batch; returns (queries, hits, tokens, context)."""
        config = self.config
        kv = self.kv
        block_size = self.profile.block_size
        running = self._running
        waiting = self._waiting
        batch_adapters = set(self._running_adapters)
        skipped: list[Request] = []
        queries = hits = used = context = 0
        while waiting and budget > 0 and len(running) < config.max_num_seqs:
            request = waiting[0]
            adapter = request.adapter
            if (
                adapter is not None
                and adapter not in batch_adapters
                and len(batch_adapters) >= config.max_loras
            ):
                skipped.append(waiting.popleft())
                continue
            cached: list[int] = []
            if kv.enable_prefix_caching:
                limit = (request.num_tokens - 1) // block_size
                self._hash_blocks(request, limit)
                cached = kv.cached_prefix(request.block_hashes[:limit])
            computed = len(cached) * block_size
            tokens = min(request.num_tokens - computed, budget)
            total = computed + tokens
            missing = -(-total // block_size) - len(cached)
            if missing > kv.num_free - kv.count_unreferenced(cached):
                break  # no room: vLLM stops admitting for this step, without preempting
            kv.take(cached)
            new_blocks = kv.allocate(missing)
            assert new_blocks is not None  # checked just above
            waiting.popleft()
            request.blocks = cached + new_blocks
            request._room = len(request.blocks) * block_size
            request._num_registered = len(cached)
            request._next_full = 0
            if request.preemptions == 0:
                queries += request.num_tokens
                hits += computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = computed
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            request.num_computed = computed
            if total >= request._next_full:
                self._register_full_blocks(request, total // block_size)
            request.status = Status.RUNNING
            running.append(request)
            if adapter is not None:
                _count_out(self._waiting_adapters, adapter)
                _count_in(self._running_adapters, adapter)
                batch_adapters.add(adapter)
            request.step_tokens = tokens
            batch.append(request)
            budget -= tokens
            used += tokens
            context += total
        if skipped:
            waiting.extendleft(reversed(skipped))
        return queries, hits, used, context

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and put it back at the front of the waiting queue."""
        self.kv.release(request.blocks)
        request.blocks = []
        request._room = 0
        request._num_registered = 0
        request._next_full = 0
        request.num_computed = 0
        request.preemptions += 1
        request.status = Status.WAITING
        self._waiting.appendleft(request)
        if request.adapter is not None:
            _count_out(self._running_adapters, request.adapter)
            _count_in(self._waiting_adapters, request.adapter)

    def _release_running(self, request: Request) -> None:
        self.kv.release(request.blocks)
        request.blocks = []
        request._room = 0
        if request.adapter is not None:
            _count_out(self._running_adapters, request.adapter)

    def _finish(self, request: Request, reason: str, now: float) -> None:
        request.status = Status.FINISHED
        request.finish_reason = reason
        request.finish_time = now
        if reason == "abort":
            self.counters.aborted += 1
        else:
            self.counters.finished += 1

    def _register_full_blocks(self, request: Request, full: int) -> None:
        """Offer the request's full blocks up to ``full`` to the prefix cache."""
        if self.kv.enable_prefix_caching:
            self._hash_blocks(request, full)
            hashes = request.block_hashes
            blocks = request.blocks
            cache = self.kv.cache
            for index in range(request._num_registered, full):
                cache(blocks[index], hashes[index])
        request._num_registered = full
        request._next_full = (full + 1) * self.profile.block_size

    def _hash_blocks(self, request: Request, count: int) -> None:
        """Extend ``request.block_hashes`` to its first ``count`` blocks."""
        hashes = request.block_hashes
        done = len(hashes)
        if done >= count:
            return
        block_size = self.profile.block_size
        adapter_key = self._adapter_keys.get(request.adapter, 0) if request.adapter else 0
        parent = hashes[-1] if hashes else adapter_key
        num_prompt = request.num_prompt_tokens
        ids = request._ids
        ends, seeds = request._segment_ends, request._segment_seeds
        segment = 0
        for start in range(done * block_size, count * block_size, block_size):
            end = start + block_size
            # Inlined fast paths of _content: whole blocks of prompt ids or of one segment.
            if end > num_prompt:
                content = _content(request, start, end)
            elif ids is not None:
                content = ids[start:end]
            else:
                while ends[segment] <= start:
                    segment += 1
                if end <= ends[segment]:
                    content = ("s", seeds[segment], start - (ends[segment - 1] if segment else 0))
                else:
                    content = _parts(request, start, end)
            parent = hash((parent, adapter_key, content))
            hashes.append(parent)


def _content(request: Request, start: int, end: int) -> tuple[object, ...]:
    """A hashable description of the full block of tokens ``start:end`` of a request."""
    num_prompt = request.num_prompt_tokens
    if end <= num_prompt:
        ids = request._ids
        if ids is not None:
            return ids[start:end]
        ends = request._segment_ends
        segment = bisect.bisect_right(ends, start)
        if end <= ends[segment]:
            offset = ends[segment - 1] if segment else 0
            return ("s", request._segment_seeds[segment], start - offset)
    elif start >= num_prompt:
        output = request.spec.output
        first = start - num_prompt
        if output is not None:
            return output[first : end - num_prompt]
        return ("o", request.serial, first)
    return _parts(request, start, end)


def _parts(request: Request, start: int, end: int) -> tuple[object, ...]:
    """The content of a block that straddles prompt segments or the prompt's end.

    Token ids stay one flat tuple across the prompt's end, so that the same tokens sent back as
    the next prompt (a multi-turn chat) describe the block the same way.
    """
    num_prompt = request.num_prompt_tokens
    ids, output = request._ids, request.spec.output
    if ids is not None and output is not None:
        return ids[start:num_prompt] + output[: end - num_prompt]
    parts: list[object] = []
    stop = min(end, num_prompt)
    if ids is not None:
        parts.append(ids[start:stop])
    else:
        ends = request._segment_ends
        starts = [0, *ends[:-1]]
        for seed, first, last in zip(request._segment_seeds, starts, ends, strict=True):
            low, high = max(start, first), min(stop, last)
            if low < high:
                parts.append(("s", seed, low - first, high - first))
    if end > num_prompt:
        first, last = max(start, num_prompt) - num_prompt, end - num_prompt
        parts.append(("o", request.serial, first, last) if output is None else output[first:last])
    return tuple(parts)


def _count_in(counts: dict[str, int], name: str) -> None:
    counts[name] = counts.get(name, 0) + 1


def _count_out(counts: dict[str, int], name: str) -> None:
    left = counts[name] - 1
    if left:
        counts[name] = left
    else:
        del counts[name]
