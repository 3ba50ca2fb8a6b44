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

Steady requests (the fast path). Most running requests are decoding: each step gives them one
token to compute, ends with one more token, and changes nothing else about them, except that
every ``block_size`` tokens one needs a new KV block (step 1) and one block becomes full (and is
offered to the prefix cache). Walking all of them every step made the simulator slow, so a
request that has emitted a token and not finished becomes *steady*: the engine notes the step
index from which it is steady (``_steady_since``) and stops updating it. Its counts
(``num_tokens``, ``num_output``, ...) are then its stored counts plus the number of steps ended
since, and its token times are those steps' end times, which the engine keeps in a ``_StepLog``;
``Request`` exposes them as properties, so readers never see the difference. A step then:

- walks, in running order, the requests that are not steady (prefilling, recomputing, just
  admitted) exactly as above, together with the steady requests filed under this step index in
  ``_block_events`` (those that need a block or fill one now: same allocation, preemption and
  prefix-cache registration, in the same order as a full walk would do them; when they only need
  a block each and blocks are plenty, ``_grow_at_once`` allocates them together);
- counts every steady request as one decode token and adds their total token count (kept in
  ``_steady_tokens``) to the context, without touching them;
- at its end, finishes the steady requests filed under this step in ``_finish_events``.

A request stops being steady (its counts are written back, ``Request._settle``) when it finishes,
is preempted or aborted. Counting steady requests without walking them is exact because the
budget never cuts a running request off, except the last one's prompt chunk: a request is
admitted only with budget left after all running ones (``_budget_serves_all_but_the_last``).

Private text (the other fast path). Hashing every full block and filing it in the prefix cache
costs as much as the rest of the engine, yet most blocks can never be found there by anyone:
those holding generated tokens unique to their request, and those after a prompt segment whose
seed no other request has used (``_seed_owner``). The engine keeps such blocks out of the cache
(``_private_from``), and puts them in when that could make a difference, so that every lookup
finds what it would have found had they been filed at once:

- when a later request uses the seed (``_share_text``): the owner's blocks, or, if it has ended,
  those of its freed blocks that nobody reallocated since (``KVCache.still_free``);
- when the request is preempted (``_publish``): it looks its own blocks up when it comes back.
  When it recomputes them, it files them at once again: their earlier copies may still be cached,
  and the first copy stays the cached one.

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
from operator import attrgetter
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


class _StepLog:
    """When each step of one engine ended: where steady requests read their token times.

    Step ``i`` (counting from 0) ended at ``ends[i - first]``, ``gaps[i - first]`` after step
    ``i - 1``: the time between the tokens a steady request got from those two steps. The engine
    drops the entries no steady request needs any more, so a long real-time run stays small.
    """

    __slots__ = ("ends", "first", "gaps")

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.gaps: list[float] = []
        self.first = 0
        """Index of the step whose end is ``ends[0]``."""

    @property
    def count(self) -> int:
        """Steps ended so far, which is also the index of the step in flight, if any."""
        return self.first + len(self.ends)

    def append(self, end: float) -> None:
        """Record that the step in flight ended at ``end``."""
        ends = self.ends
        self.gaps.append(end - ends[-1] if ends else 0.0)
        ends.append(end)

    def forget_before(self, step: int) -> None:
        """Drop the entries of the steps before ``step`` (keeping at least the last one)."""
        drop = min(step, self.count - 1) - self.first
        if drop > 0:
            del self.ends[:drop]
            del self.gaps[:drop]
            self.first += drop


class Request:
    """A submitted request and its progress; the engine mutates it, drivers read it.

    While the request is steady (see the module docstring) the fields behind ``num_tokens``,
    ``num_computed``, ``num_output``, ``last_token_time``, ``last_gap``, ``max_gap`` and
    ``token_times`` hold their values at ``_steady_since``; the properties add the steps since.
    """

    __slots__ = (
        "_abort",
        "_block_step",
        "_finish_step",
        "_ids",
        "_last_gap",
        "_last_token_time",
        "_log",
        "_max_gap",
        "_next_full",
        "_num_computed",
        "_num_offered",
        "_num_output",
        "_num_published",
        "_num_registered",
        "_num_tokens",
        "_order",
        "_parked_blocks",
        "_parked_position",
        "_private_from",
        "_room",
        "_segment_ends",
        "_segment_keys",
        "_segment_seeds",
        "_steady_since",
        "_token_times",
        "adapter",
        "arrival_time",
        "block_hashes",
        "blocks",
        "finish_reason",
        "finish_time",
        "first_scheduled_time",
        "first_token_time",
        "max_tokens",
        "num_cached_tokens",
        "num_prompt_tokens",
        "preemptions",
        "request_id",
        "serial",
        "spec",
        "status",
        "step_tokens",
        "watcher",
    )

    def __init__(
        self, spec: RequestSpec, serial: int, arrival_time: float, num_prompt: int, log: _StepLog
    ):
        self.spec = spec
        self.request_id = spec.request_id
        self.adapter = spec.adapter
        self.serial = serial
        self.arrival_time = arrival_time
        self.num_prompt_tokens = num_prompt
        self.max_tokens = spec.max_tokens
        self._num_tokens = num_prompt
        self._num_computed = 0
        self._num_output = 0
        self.blocks: list[int] = []
        self.block_hashes: list[int] = []
        self._num_registered = 0  # its full blocks: the first ones, computed or being computed
        self._num_offered = 0  # its first blocks offered to the prefix cache (<= _num_registered)
        self._private_from = _NEVER  # its first block no other request can share (see engine)
        self._num_published = 0  # its first blocks offered when it was preempted
        self._next_full = 0  # context length at which another block is full (to register)
        self._parked_blocks: list[int] | None = None  # its blocks, freed with private content
        self._parked_position = 0  # the free queue position its last block took then
        self._room = 0  # tokens the allocated blocks hold
        self.num_cached_tokens = -1
        self.preemptions = 0
        self.status = Status.WAITING
        self.step_tokens = 0
        """Tokens scheduled for it in the step in flight (not kept up to date while steady)."""
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self._last_token_time = 0.0
        self._last_gap = 0.0
        self._max_gap = 0.0
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self._token_times: list[float] | None = None
        self.watcher: Callable[[], None] | None = None
        """Called by real-time drivers after each token and at the end."""
        self._abort = False
        self._log = log
        self._steady_since = -1  # index of the first step it got a token from while steady
        self._order = 0  # position in the running list: larger = admitted later
        self._block_step = -1  # the step it is filed under in the engine's _block_events
        self._finish_step = -1  # the step it is filed under in the engine's _finish_events
        prompt = spec.prompt
        self._ids = prompt if isinstance(prompt, tuple) else None
        segments = () if isinstance(prompt, tuple) else prompt.segments
        self._segment_ends = list(itertools.accumulate(length for _, length in segments))
        self._segment_seeds = [seed for seed, _ in segments]
        # What stands for a segment's tokens in block contents: its seed, doubled because
        # CPython hashes -1 like -2 (equal hashes would make two texts share cached blocks).
        self._segment_keys = [2 * seed for seed, _ in segments]

    @property
    def finished(self) -> bool:
        """True once the request completed or was aborted."""
        return self.status is Status.FINISHED

    @property
    def num_tokens(self) -> int:
        """Tokens of its context: the prompt and every token generated so far."""
        return self._num_tokens + self._steady_steps()

    @property
    def num_computed(self) -> int:
        """Tokens of its context whose KV is computed (all but the newest while decoding)."""
        return self._num_computed + self._steady_steps()

    @property
    def num_output(self) -> int:
        """Tokens generated so far."""
        return self._num_output + self._steady_steps()

    @property
    def last_token_time(self) -> float:
        """When its newest token was emitted (0.0 before the first)."""
        return self._log.ends[-1] if self._steady_steps() else self._last_token_time

    @property
    def last_gap(self) -> float:
        """Seconds between its two newest tokens (0.0 before the second)."""
        return self._log.gaps[-1] if self._steady_steps() else self._last_gap

    @property
    def max_gap(self) -> float:
        """The longest time between two of its consecutive tokens so far."""
        if self._steady_steps():
            log = self._log
            steady = max(log.gaps[self._steady_since - log.first :])
            return steady if steady > self._max_gap else self._max_gap
        return self._max_gap

    @property
    def token_times(self) -> list[float] | None:
        """Every token's time, when the engine config has ``record_token_times``."""
        times = self._token_times
        if times is not None and self._steady_steps():
            log = self._log
            return times + log.ends[self._steady_since - log.first :]
        return times

    def _steady_steps(self) -> int:
        """Tokens it got while steady and not yet written to its fields (0 when not steady)."""
        since = self._steady_since
        return self._log.count - since if since >= 0 else 0

    def _settle(self) -> None:
        """Write the tokens it got while steady into its fields; it is no longer steady."""
        steps = self._steady_steps()
        if steps:
            log = self._log
            start, end = self._steady_since - log.first, log.count - log.first
            self._num_tokens += steps
            self._num_computed += steps
            self._num_output += steps
            self._last_token_time = log.ends[end - 1]
            self._last_gap = log.gaps[end - 1]
            steady_max = max(log.gaps[start:end])
            if steady_max > self._max_gap:
                self._max_gap = steady_max
            if self._token_times is not None:
                self._token_times += log.ends[start:end]
        self._steady_since = -1


_running_order = attrgetter("_order")


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
        self._loose: list[Request] = []
        """The running requests that are not steady, in running order."""
        self._running_adapters: dict[str, int] = {}
        self._waiting_adapters: dict[str, int] = {}
        self._serial = 0
        self._admitted = 0
        self._log = _StepLog()
        self._log_limit = _LOG_CHUNK
        self._steady = 0
        """How many running requests are steady."""
        self._steady_tokens = 0
        """The sum of their ``num_tokens``: the context they attend to in the next step."""
        self._block_events: dict[int, list[Request]] = {}
        """Steady requests by the step index at which they need a block or fill one."""
        self._finish_events: dict[int, list[Request]] = {}
        """Steady requests by the step index that gives them their last token."""
        self._seed_owner: dict[int, Request] = {}
        """Prompt segment seeds that one request only has used: its private text."""
        self._shared_seeds: set[int] = set()
        self._parked: deque[tuple[int, Request]] = deque()
        """Ended requests whose freed blocks may still hold private text, oldest first, with
        the free queue position after which none of those blocks does."""
        self._batch: list[Request] | None = None
        self._walked: list[Request] = []
        self._plan: StepPlan | None = None
        self._step_queries = 0
        self._step_hits = 0
        self._step_preempted = 0
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
        request = Request(spec, self._serial, self.clock.now(), num_prompt, self._log)
        if self.config.record_token_times:
            request._token_times = []
        self._claim_seeds(request)
        self._waiting.append(request)
        if request.adapter is not None:
            _count_in(self._waiting_adapters, request.adapter)
        return request

    def abort(self, request: Request) -> None:
        """Drop ``request``: now if it is not in the step in flight, else when that step ends."""
        if request.status is Status.FINISHED or request._abort:
            return  # already dropped, or to be dropped when the step in flight ends
        if request.status is Status.WAITING:
            self._waiting.remove(request)
            if request.adapter is not None:
                _count_out(self._waiting_adapters, request.adapter)
            self._disown(request)
            self._finish(request, "abort", self.clock.now())
            return
        if request._steady_since >= 0:
            self._unsteady(request)
            self._loose.append(request)  # gets no more tokens: the walk skips aborted requests
        if self._batch is not None and request in self._batch:
            request._abort = True
            request.step_tokens = 0  # so that the step's end computes nothing for it
            self._aborting.append(request)
            return
        self._loose.remove(request)
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
        step = self._log.count
        budget = self.config.max_num_batched_tokens
        running = self._running
        assert not running or self._budget_serves_all_but_the_last(budget)

        # Step 1, running requests in order: the ones that are not steady, and the steady ones
        # that need a KV block or fill one now. Every steady request takes one token of the
        # budget, wherever it sits (the assertion above says that cuts nobody off).
        due = self._block_events.pop(step, [])
        due.sort(key=_running_order)
        if due and self._grow_at_once(due, step):
            due = []
        walk = sorted(self._loose + due, key=_running_order)
        budget -= self._steady
        prefill = decode = context = 0
        self._step_preempted = 0
        walked: list[Request] = []
        for request in walk:
            if request.status is not Status.RUNNING:
                continue  # preempted by an allocation earlier in this step
            since = request._steady_since
            if since >= 0:
                if not self._reserve(request, request._num_tokens + step - since):
                    break
                self._file_block_event(request)
                continue
            computed = request._num_computed
            tokens = request._num_tokens - computed
            if tokens > budget:
                tokens = budget  # the last running request: a chunk of its prompt
            total = computed + tokens
            if not self._reserve(request, total):
                break  # it preempted itself, the last one left: nobody follows it
            request.step_tokens = tokens
            walked.append(request)
            budget -= tokens
            if tokens == 1 and request._num_output and total == request._num_tokens:
                decode += 1
            else:
                prefill += tokens
            context += total
        decode += self._steady
        context += self._steady_tokens
        preempted = self._step_preempted

        # Step 2, waiting requests.
        queries = hits = 0
        if not preempted and self._waiting:
            queries, hits, admitted_tokens, admitted_context = self._admit(now, budget, walked)
            prefill += admitted_tokens
            context += admitted_context
        self.counters.preemptions += preempted
        batch = running.copy()  # every running request is in the step
        if not batch:
            return None

        # Step 3, the step's duration.
        adapters: frozenset[str] = frozenset()
        load = NO_LOAD
        if self._known_adapters:
            adapters = frozenset(self._running_adapters)
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
        self._walked = walked
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
        step = self._log.count
        self._log.append(now)  # every steady request now has a token stamped ``now``
        result = StepResult(plan, now, self._step_queries, self._step_hits)
        emitted = result.emitted = batch  # less the requests that get no token, below
        done, self._aborting = self._aborting, []
        for request in done:
            emitted.remove(request)
        ended: list[Request] = []
        newly_steady: list[Request] = []
        for request in self._walked:
            if request._abort:
                continue
            computed = request._num_computed + request.step_tokens
            request._num_computed = computed
            if computed < request._num_tokens:
                emitted.remove(request)  # a prefill chunk short of the prompt's end
                continue
            request._num_tokens += 1
            output = request._num_output + 1
            request._num_output = output
            if output == 1:
                request.first_token_time = now
                result.prompt_tokens += request.num_prompt_tokens
            else:
                gap = now - request._last_token_time
                request._last_gap = gap
                if gap > request._max_gap:
                    request._max_gap = gap
            request._last_token_time = now
            if request._token_times is not None:
                request._token_times.append(now)
            if output >= request.max_tokens:
                ended.append(request)
            else:
                newly_steady.append(request)
        self._walked = []
        self._steady_tokens += self._steady
        ended += self._finish_events.pop(step, ())
        counters = self.counters
        counters.generation_tokens += len(emitted)
        counters.prompt_tokens += result.prompt_tokens
        if ended:
            ended.sort(key=_running_order)  # freed in batch order, as the full walk did
            done += ended
        if done:
            running = self._running
            for request in done:
                if request._steady_since >= 0:
                    self._unsteady(request)
                running.remove(request)
                self._release_running(request)
                reason = "abort" if request._abort else request.spec.finish_reason
                self._finish(request, reason, now)
            result.finished = done
        for request in newly_steady:
            self._make_steady(request)
        if done or newly_steady:
            self._loose = [
                r for r in self._loose if r.status is Status.RUNNING and r._steady_since < 0
            ]
        if len(self._log.ends) > self._log_limit:
            self._trim_log()
        parked = self._parked
        if parked and parked[0][0] < self.kv.dequeued:
            self._forget_parked()
        return result

    # ---- internals ---------------------------------------------------------------------------

    def _admit(self, now: float, budget: int, walked: list[Request]) -> tuple[int, int, int, int]:
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
            request._private_from = self._first_private_block(request)
            if kv.enable_prefix_caching:
                limit = (request._num_tokens - 1) // block_size
                if not request.preemptions:
                    # Nothing of its private text is cached yet: the lookup would miss there.
                    limit = min(limit, request._private_from)
                self._hash_blocks(request, limit)
                cached = kv.cached_prefix(request.block_hashes[:limit])
            computed = len(cached) * block_size
            tokens = min(request._num_tokens - computed, budget)
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
            request._num_registered = request._num_offered = len(cached)
            request._next_full = 0
            if request.preemptions == 0:
                queries += request._num_tokens
                hits += computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = computed
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            request._num_computed = computed
            if total >= request._next_full:
                self._register_full_blocks(request, total // block_size)
            request.status = Status.RUNNING
            self._admitted += 1
            request._order = self._admitted
            running.append(request)
            self._loose.append(request)
            if adapter is not None:
                _count_out(self._waiting_adapters, adapter)
                _count_in(self._running_adapters, adapter)
                batch_adapters.add(adapter)
            request.step_tokens = tokens
            walked.append(request)
            budget -= tokens
            used += tokens
            context += total
        if skipped:
            waiting.extendleft(reversed(skipped))
        return queries, hits, used, context

    def _reserve(self, request: Request, total: int) -> bool:
        """Give ``request`` KV room for ``total`` tokens and offer its blocks that are then full
        to the prefix cache. While blocks are short the newest running request is preempted;
        returns False if that was ``request`` itself."""
        if total > request._room:
            block_size = self.profile.block_size
            missing = -(-total // block_size) - len(request.blocks)
            new_blocks = self.kv.allocate(missing)
            while new_blocks is None:
                victim = self._running.pop()
                self._preempt(victim)
                self._step_preempted += 1
                if victim is request:
                    return False
                new_blocks = self.kv.allocate(missing)
            request.blocks.extend(new_blocks)
            request._room = len(request.blocks) * block_size
        if total >= request._next_full:
            self._register_full_blocks(request, total // self.profile.block_size)
        return True

    def _grow_at_once(self, due: list[Request], step: int) -> bool:
        """Give each of the steady requests ``due`` at ``step`` (in running order) its next
        block with a single allocation, if that is what the walk would do: they only need a
        block (their generated tokens are private, nothing to offer), they come before every
        request that is not steady, and there are blocks enough for all (no preemption)."""
        if len(due) > self.kv.num_free or any(r.spec.output is not None for r in due):
            return False
        if self._loose and min(r._order for r in self._loose) < due[-1]._order:
            return False
        new_blocks = self.kv.allocate(len(due))
        assert new_blocks is not None  # checked just above
        block_size = self.profile.block_size
        next_step = step + block_size  # one token per step: the new block is full by then
        refiled = []
        for request, block in zip(due, new_blocks, strict=True):
            request.blocks.append(block)
            request._room += block_size
            if next_step <= request._finish_step:
                request._block_step = next_step
                refiled.append(request)
            else:
                request._block_step = -1
        if refiled:
            self._block_events.setdefault(next_step, []).extend(refiled)
        return True

    def _budget_serves_all_but_the_last(self, budget: int) -> bool:
        """True if every running request but the last gets all the tokens it wants (a steady
        request wants one) from ``budget``, so the budget cuts none of them off.

        This always holds: a request is admitted only with budget left after every running
        request, each one got at least one token in the last step, and all but the last of
        them caught up with their tokens then, so they want one token each now.
        """
        wanted = self._steady + sum(r._num_tokens - r._num_computed for r in self._loose)
        last = self._running[-1]
        last_wants = 1 if last._steady_since >= 0 else last._num_tokens - last._num_computed
        return wanted - last_wants < budget

    def _make_steady(self, request: Request) -> None:
        """Stop walking ``request`` (it just emitted a token and wants one per step from now)."""
        since = self._log.count
        request._steady_since = since
        self._steady += 1
        self._steady_tokens += request._num_tokens
        # Its last token comes from step ``since + tokens left - 1``.
        request._finish_step = since + request.max_tokens - request._num_output - 1
        self._finish_events.setdefault(request._finish_step, []).append(request)
        self._file_block_event(request)

    def _file_block_event(self, request: Request) -> None:
        """File a steady request under the next step that needs a block for it or fills one."""
        # At step ``s`` it computes up to num_tokens + s - since tokens: it outgrows its blocks
        # at room + 1 and fills a block at _next_full.
        step = request._steady_since - request._num_tokens + request._room + 1
        if request.spec.output is not None:
            step = min(step, request._steady_since - request._num_tokens + request._next_full)
        # else the blocks it fills hold generated tokens unique to it: private, nothing to offer
        # (its full blocks are counted when it stops being steady, see _unsteady).
        if step <= request._finish_step:
            request._block_step = step
            self._block_events.setdefault(step, []).append(request)
        else:
            request._block_step = -1

    def _unsteady(self, request: Request) -> None:
        """Write a steady request's counts back into it and take it off the event lists."""
        self._steady -= 1
        request._settle()
        self._steady_tokens -= request._num_tokens
        full = request._num_computed // self.profile.block_size
        if full > request._num_registered:  # the blocks it filled while steady, unoffered
            request._num_registered = full
            request._next_full = (full + 1) * self.profile.block_size
        for events, step in (
            (self._block_events, request._block_step),
            (self._finish_events, request._finish_step),
        ):
            filed = events.get(step)
            if filed is not None:  # None: popped, this step's events are being handled
                filed.remove(request)
        request._block_step = request._finish_step = -1

    def _trim_log(self) -> None:
        """Forget the step end times older than every steady request's start."""
        log = self._log
        starts = [r._steady_since for r in self._running if r._steady_since >= 0]
        log.forget_before(min(starts, default=log.count))
        self._log_limit = len(log.ends) + _LOG_CHUNK

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and put it back at the front of the waiting queue."""
        if request._steady_since >= 0:
            self._unsteady(request)
        else:
            self._loose.remove(request)
        self._publish(request, request._num_registered)  # it will look its blocks up again
        request._num_published = max(request._num_published, request._num_registered)
        self.kv.release(request.blocks)
        request.blocks = []
        request._room = 0
        request._num_registered = 0
        request._next_full = 0
        request._num_computed = 0
        request.preemptions += 1
        request.status = Status.WAITING
        self._waiting.appendleft(request)
        if request.adapter is not None:
            _count_out(self._running_adapters, request.adapter)
            _count_in(self._waiting_adapters, request.adapter)

    def _release_running(self, request: Request) -> None:
        """Free the blocks of a request that ended; keep track of the private text in them."""
        kv = self.kv
        if kv.enable_prefix_caching and request._num_offered < self._reachable(request):
            # A later request with one of its seeds could look them up: see _share_text.
            request._parked_blocks = request.blocks
            request._parked_position = kv.queued
            # Of the blocks it keeps private, the first is freed last (see KVCache.release).
            last = kv.queued + len(request.blocks) - 1 - request._num_offered
            self._parked.append((last, request))
        else:
            self._disown(request)
        kv.release(request.blocks)
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
        """Note that the request's first ``full`` blocks are full, and offer the ones that are
        not private to the prefix cache."""
        end = min(full, request._private_from)
        if request._num_offered < end and self.kv.enable_prefix_caching:
            self._offer(request, end, request.blocks)
        request._num_registered = full
        request._next_full = (full + 1) * self.profile.block_size

    def _offer(self, request: Request, end: int, blocks: list[int], parked: bool = False) -> None:
        """Put the request's blocks from ``_num_offered`` to ``end`` in the prefix cache; if
        ``parked`` (``blocks`` were freed), only those still free since."""
        self._hash_blocks(request, end)
        hashes = request.block_hashes
        kv = self.kv
        last = request._parked_position + len(blocks) - 1  # the free queue position of blocks[0]
        for index in range(request._num_offered, end):
            if not parked or kv.still_free(last - index):
                kv.cache(blocks[index], hashes[index])
        request._num_offered = end

    # ---- private text ------------------------------------------------------------------------

    def _claim_seeds(self, request: Request) -> None:
        """Note the prompt segments whose seed no other request has used: its private text. A
        seed used again makes the text of its first user public."""
        if not self.kv.enable_prefix_caching:
            return
        owners = self._seed_owner
        for seed in request._segment_seeds:
            if seed in self._shared_seeds:
                continue
            owner = owners.get(seed)
            if owner is None:
                owners[seed] = request
            elif owner is not request:
                self._share_text(owner)

    def _first_private_block(self, request: Request) -> int:
        """The first block of ``request`` that no other request can have the same content in:
        the first touching its private text or (with no ``output`` ids) its generated tokens.
        Blocks it published when preempted come before it: when recomputed, their copies may
        still be cached, and the first copy stays the cached one (``KVCache.cache``)."""
        block_size = self.profile.block_size
        first = request.num_prompt_tokens // block_size if request.spec.output is None else _NEVER
        start = 0
        for seed, end in zip(request._segment_seeds, request._segment_ends, strict=True):
            if self._seed_owner.get(seed) is request:
                first = min(first, start // block_size)
                break
            start = end
        return max(first, request._num_published)

    def _reachable(self, request: Request) -> int:
        """How many of the request's first blocks another request could have the same content
        in (once its text is public): all full ones, except those holding generated tokens
        unique to it."""
        if request.spec.output is None:
            return min(
                request._num_registered, request.num_prompt_tokens // self.profile.block_size
            )
        return request._num_registered

    def _share_text(self, owner: Request) -> None:
        """Another request uses a seed of ``owner``'s private text: offer the blocks ``owner``
        kept out of the prefix cache (that request may look them up) and make its text
        public."""
        self._publish(owner, self._reachable(owner))
        if owner.status is Status.RUNNING:
            owner._private_from = self._first_private_block(owner)

    def _publish(self, request: Request, end: int) -> None:
        """Make the request's text public, and offer its blocks up to ``end`` to the prefix
        cache: those it holds, or the freed ones that still hold its content."""
        for seed in request._segment_seeds:
            if self._seed_owner.get(seed) is request:
                del self._seed_owner[seed]
                self._shared_seeds.add(seed)
        if request._num_offered < end and self.kv.enable_prefix_caching:
            if request._parked_blocks is None:
                self._offer(request, end, request.blocks)
            else:
                self._offer(request, end, request._parked_blocks, parked=True)
        request._parked_blocks = None

    def _disown(self, request: Request) -> None:
        """Forget that ``request`` owns seeds: none of its private text is in the cache."""
        for seed in request._segment_seeds:
            if self._seed_owner.get(seed) is request:
                del self._seed_owner[seed]

    def _forget_parked(self) -> None:
        """Stop tracking freed private text once every block that held it was reallocated."""
        dequeued = self.kv.dequeued
        parked = self._parked
        while parked and parked[0][0] < dequeued:
            request = parked.popleft()[1]
            if request._parked_blocks is not None:  # not published in the meantime
                request._parked_blocks = None
                self._disown(request)

    # ---- block hashes ------------------------------------------------------------------------

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
        ends, keys = request._segment_ends, request._segment_keys
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
                    content = ("s", keys[segment], start - (ends[segment - 1] if segment else 0))
                else:
                    content = _parts(request, start, end)
            parent = hash((parent, adapter_key, content))
            hashes.append(parent)


_LOG_CHUNK = 4096
"""Step end times an engine keeps beyond those its steady requests need, before trimming."""

_NEVER = 1 << 62
"""A block index no request reaches."""


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
            return ("s", request._segment_keys[segment], start - offset)
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
        for key, first, last in zip(request._segment_keys, starts, ends, strict=True):
            low, high = max(start, first), min(stop, last)
            if low < high:
                parts.append(("s", key, low - first, high - first))
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
