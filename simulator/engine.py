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

The engine's other jobs live in their own modules: the request record (``request``), the
timeline of step ends (``step_log``), the fast path for decoding requests (``steady``), which
full blocks go into the prefix cache and when (``prefix_sharing``, over ``block_hashes`` and the
paged ``kv_cache``), LoRA slots (``lora``), and what it reports (``reports``). Every public name
of those modules that drivers use is importable from here too.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Protocol

import msgspec

from shared.errors import LigError
from simulator.kv_cache import KVCache
from simulator.lora import NO_LOAD, AdapterSlots
from simulator.prefix_sharing import PrefixSharing
from simulator.profiles import DEFAULT_PROFILE, PROFILES, Profile
from simulator.reports import EngineCounters, EngineSnapshot, StepPlan, StepResult
from simulator.request import Request, RequestSpec, Status, SyntheticPrompt, running_order
from simulator.steady import SteadyRequests

__all__ = [
    "Clock",
    "Engine",
    "EngineConfig",
    "EngineCounters",
    "EngineSnapshot",
    "Request",
    "RequestRejected",
    "RequestSpec",
    "Status",
    "StepPlan",
    "StepResult",
    "SyntheticPrompt",
    "UnknownAdapterError",
]


class Clock(Protocol):
    """Where the engine reads the time, in simulated seconds."""

    def now(self) -> float: ...


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


class RequestRejected(LigError, ValueError):
    """A request the server refuses (HTTP 400 in vLLM)."""


class UnknownAdapterError(RequestRejected):
    """The request names an adapter the server does not have (HTTP 404 in vLLM)."""


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
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._loose: list[Request] = []
        """The running requests that are not steady, in running order."""
        self._running_adapters: dict[str, int] = {}
        self._waiting_adapters: dict[str, int] = {}
        self._serial = 0
        self._admitted = 0
        self._steady = SteadyRequests(self.kv)
        """The running requests the engine does not walk while they decode (the fast path)."""
        self._prefix = PrefixSharing(self.kv, config.adapters)
        """Which of the requests' full blocks are in the prefix cache, and who may share them."""
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
        request = Request(spec, self._serial, self.clock.now(), num_prompt, self._steady.log)
        if self.config.record_token_times:
            request._token_times = []
        self._prefix.claim_seeds(request)
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
            self._prefix.disown(request)
            self._finish(request, "abort", self.clock.now())
            return
        if request._steady_since >= 0:
            self._steady.unsteady(request)
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
        steady = self._steady
        step = steady.log.count
        budget = self.config.max_num_batched_tokens
        running = self._running
        assert not running or steady.serves_all_but_the_last(budget, running, self._loose)

        # Step 1, running requests in order: the ones that are not steady, and the steady ones
        # that need a KV block or fill one now. Every steady request takes one token of the
        # budget, wherever it sits (the assertion above says that cuts nobody off).
        due = steady.due(step, self._loose)
        walk = sorted(self._loose + due, key=running_order)
        budget -= steady.count
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
                steady.file_block_event(request)
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
        decode += steady.count
        context += steady.tokens
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
        steady = self._steady
        step = steady.end_step(now)  # every steady request now has a token stamped ``now``
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
        ended += steady.finishing(step)
        counters = self.counters
        counters.generation_tokens += len(emitted)
        counters.prompt_tokens += result.prompt_tokens
        if ended:
            ended.sort(key=running_order)  # freed in batch order, as the full walk did
            done += ended
        if done:
            running = self._running
            for request in done:
                if request._steady_since >= 0:
                    steady.unsteady(request)
                running.remove(request)
                self._release_running(request)
                reason = "abort" if request._abort else request.spec.finish_reason
                self._finish(request, reason, now)
            result.finished = done
        for request in newly_steady:
            steady.make_steady(request)
        if done or newly_steady:
            self._loose = [
                r for r in self._loose if r.status is Status.RUNNING and r._steady_since < 0
            ]
        steady.trim_log(self._running)
        self._prefix.forget_reallocated()
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
            cached = self._prefix.lookup(request)
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
                self._prefix.register_full_blocks(request, total // block_size)
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
            self._prefix.register_full_blocks(request, total // self.profile.block_size)
        return True

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and put it back at the front of the waiting queue."""
        if request._steady_since >= 0:
            self._steady.unsteady(request)
        else:
            self._loose.remove(request)
        self._prefix.preempted(request)
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
        self._prefix.park(request)
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


def _count_in(counts: dict[str, int], name: str) -> None:
    counts[name] = counts.get(name, 0) + 1


def _count_out(counts: dict[str, int], name: str) -> None:
    left = counts[name] - 1
    if left:
        counts[name] = left
    else:
        del counts[name]
