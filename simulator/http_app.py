"""One simulated vLLM pod: an engine running in real time behind vLLM's HTTP API, with faults.

Routes, as vLLM's OpenAI-compatible server answers them:

- ``POST /v1/completions``, ``POST /v1/chat/completions``: streamed (SSE) or whole. The output
  has ``max_tokens`` tokens (``max_completion_tokens`` for chat), finish reason "length"; without
  it, a seeded draw (log-normal around ``output_len_median``) with finish reason "stop". A model
  name that is neither the base model nor a configured adapter gets vLLM's 404.
- ``GET /v1/models`` (base model and adapters), ``GET /health``, ``GET /metrics``.
- ``GET /admin/faults`` and ``POST /admin/faults`` (the simulator's own): read or change
  ``{"failure_rate": 0..1, "metrics_delay": wall seconds, "hang": bool, "gray": "" | "hang" |
  "error"}``. A POST changes only the fields it names. ``failure_rate`` answers that fraction of
  completions with a 500; ``metrics_delay`` holds ``/metrics`` answers; ``hang`` holds every
  request except ``/admin`` until it is cleared. ``gray`` makes a gray pod: ``/metrics``,
  ``/health`` and ``/v1/models`` answer as usual (an idle pod), but completions are held
  without an answer until it is cleared (``"hang"``) or answered 500 at once (``"error"``).

Latencies inside the engine are simulated seconds; with ``time_scale`` 10, a client sees them ten
times shorter on the wall clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec

from scheduling.token_blocks import PromptTokenizer
from simulator import tokenizer
from simulator.engine import (
    Engine,
    EngineConfig,
    Request,
    RequestRejected,
    RequestSpec,
    StepResult,
    UnknownAdapterError,
)
from simulator.http_server import HttpRequest, Response, StreamResponse, serve
from simulator.kv_events import EventPublisher, KVEventsConfig, Wire
from simulator.metrics_page import MetricsPage
from simulator.openai_api import (
    ApiError,
    CompletionCall,
    ResponseWriter,
    error_body,
    parse_completion,
)
from simulator.realtime import EngineRunner, PacedClock
from simulator.virtual_time import engine_rng

log = logging.getLogger("lig.sim")
_json = msgspec.json.Encoder()
GRAY_MODES = ("", "hang", "error")


class Faults(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Failures a pod injects on purpose."""

    failure_rate: float = 0.0
    """Fraction of completion requests answered with a 500."""
    metrics_delay: float = 0.0
    """Wall seconds every ``/metrics`` answer is held."""
    hang: bool = False
    """Hold every request except ``/admin/*`` until cleared."""
    gray: str = ""
    """Completions only: ``"hang"`` holds them until cleared, ``"error"`` answers 500 at once;
    everything else (metrics showing an idle pod, health) is served as usual."""

    def validate(self) -> Faults:
        """Return self, or raise ValueError naming the field out of range."""
        if not 0.0 <= self.failure_rate <= 1.0:
            raise ValueError("failure_rate must be between 0 and 1")
        if not 0.0 <= self.metrics_delay <= 3600.0:
            raise ValueError("metrics_delay must be between 0 and 3600 seconds")
        if self.gray not in GRAY_MODES:
            raise ValueError(f"gray must be one of {', '.join(map(repr, GRAY_MODES))}")
        return self


class PodSettings(msgspec.Struct, frozen=True):
    """Everything that makes one simulated pod."""

    engine: EngineConfig
    index: int = 0
    time_scale: float = 1.0
    metrics_format: str = "v1"
    seed: int = 0
    output_len_median: float = 128.0
    faults: Faults = Faults()
    kv_events: KVEventsConfig = KVEventsConfig()
    kv_events_wire: Wire = Wire()
    tokenizer: str | None = None  # --tokenizer (None: scheduling/lig_sim_tokenizer.py)
    # --enable-prompt-tokens-details: usage reports the prompt tokens found in the prefix cache.
    prompt_tokens_details: bool = False


class KVEventFault(msgspec.Struct, frozen=True):
    """``POST /admin/kv-events``: the next ``drop`` batches are buffered for replay but not
    sent on the PUB socket (what a subscriber that lost messages sees)."""

    drop: int = 0


Route = Callable[[HttpRequest], Awaitable[Response | StreamResponse]]


class SimulatedPod:
    """An engine, its real-time runner, its metrics page and its HTTP routes."""

    def __init__(self, settings: PodSettings,
                 prompt_tokenizer: PromptTokenizer | None = None) -> None:
        self.settings = settings
        self._prompt_tokenizer = prompt_tokenizer  # settings.tokenizer, loaded
        config = settings.engine
        self.clock = PacedClock(settings.time_scale)
        self.engine = Engine(config, self.clock, engine_rng(settings.seed, settings.index))
        self.metrics = MetricsPage(config, settings.metrics_format)
        self.runner = EngineRunner(self.engine, self.clock, on_step=self._record_step)
        self.faults = settings.faults.validate()
        self._unhung = asyncio.Event()
        if not self.faults.hang:
            self._unhung.set()
        self._ungray = asyncio.Event()
        if self.faults.gray != "hang":
            self._ungray.set()
        # Separate streams, so that faults never change which outputs the engine sees.
        self._output_rng = random.Random(settings.seed * 7_919 + settings.index)
        self._fault_rng = random.Random(settings.seed * 104_729 + settings.index)
        self._models = {config.model: None} | {name: name for name in config.adapters}
        self._created = int(time.time())
        self._routes: dict[tuple[str, str], Route] = {
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat_completions,
            ("GET", "/v1/models"): self._list_models,
            ("GET", "/health"): self._health,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/admin/faults"): self._get_faults,
            ("POST", "/admin/faults"): self._set_faults,
            ("GET", "/admin/kv-events"): self._get_kv_event_fault,
            ("POST", "/admin/kv-events"): self._set_kv_event_fault,
        }
        self.kv_events: EventPublisher | None = None
        self._task: asyncio.Task[None] | None = None
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        """Start stepping the engine and listening on ``host:port`` (and publishing KV-cache
        events on their port + the pod's index, when configured)."""
        config = self.settings.kv_events
        if config.enabled:
            self.kv_events = EventPublisher(config, self.settings.kv_events_wire, host,
                                            self.settings.index)
            self.kv_events.start()
            self.engine.kv.events = []
        self._task = asyncio.create_task(self.runner.run(), name=f"sim-pod-{self.settings.index}")
        self._task.add_done_callback(self._runner_stopped)
        self._server = await serve(self.handle, error_body, host, port)

    def _runner_stopped(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("pod %d: engine stopped", self.settings.index, exc_info=task.exception())

    async def stop(self) -> None:
        """Stop listening and stepping."""
        if self._server is not None:
            self._server.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.kv_events is not None:
            await self.kv_events.close()

    def set_faults(self, faults: Faults) -> None:
        """Replace the injected faults."""
        self.faults = faults.validate()
        if faults.hang:
            self._unhung.clear()
        else:
            self._unhung.set()
        if faults.gray == "hang":
            self._ungray.clear()
        else:
            self._ungray.set()

    async def handle(self, request: HttpRequest) -> Response | StreamResponse:
        """Answer one HTTP request."""
        route = self._routes.get((request.method, request.path))
        if route is None:
            if any(path == request.path for _, path in self._routes):
                return Response(405, b'{"detail":"Method Not Allowed"}')
            return Response(404, b'{"detail":"Not Found"}')
        if not request.path.startswith("/admin/") and self.faults.hang:
            await self._unhung.wait()
        return await route(request)

    # ---- routes ------------------------------------------------------------------------------

    async def _health(self, _: HttpRequest) -> Response:
        return Response(200)

    async def _list_models(self, _: HttpRequest) -> Response:
        config = self.settings.engine
        cards = [self._model_card(config.model, None)]
        cards += [self._model_card(name, config.model) for name in config.adapters]
        return Response(200, _json.encode({"object": "list", "data": cards}))

    def _model_card(self, name: str, parent: str | None) -> dict[str, object]:
        return {
            "id": name,
            "object": "model",
            "created": self._created,
            "owned_by": "vllm",
            "root": name,
            "parent": parent,
            "max_model_len": self.settings.engine.profile.max_model_len,
        }

    async def _metrics(self, _: HttpRequest) -> Response:
        if self.faults.metrics_delay:
            await asyncio.sleep(self.faults.metrics_delay)
        page = self.metrics.render(self.engine.snapshot())
        return Response(200, page, "text/plain; version=0.0.4; charset=utf-8")

    async def _get_faults(self, _: HttpRequest) -> Response:
        return Response(200, _json.encode(self.faults))

    async def _set_faults(self, request: HttpRequest) -> Response:
        try:
            changes = msgspec.json.decode(request.body)
            if not isinstance(changes, dict):
                raise ValueError("expected a JSON object of fault fields")
            merged = msgspec.structs.asdict(self.faults) | changes
            self.set_faults(msgspec.convert(merged, Faults))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as error:
            return Response(400, error_body(400, f"invalid faults: {error}"))
        return Response(200, _json.encode(self.faults))

    async def _completions(self, request: HttpRequest) -> Response | StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat_completions(self, request: HttpRequest) -> Response | StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, http: HttpRequest, chat: bool) -> Response | StreamResponse:
        if self.faults.gray == "hang":
            await self._ungray.wait()  # what the metrics say stays true: nothing runs
        try:
            call = parse_completion(http.body, chat, self.settings.engine.model,
                                    self._prompt_tokenizer)
            if call.model not in self._models:
                raise ApiError(404, f"The model `{call.model}` does not exist.")
            if self.faults.gray == "error":
                raise ApiError(500, "simulated failure (gray fault)")
            if self._fault_rng.random() < self.faults.failure_rate:
                raise ApiError(500, "simulated failure (failure_rate fault)")
            request, words = self._submit(call)
        except ApiError as error:
            return Response(error.status, error_body(error.status, error.message))
        writer = ResponseWriter(
            call, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        )
        progress = asyncio.Event()
        request.watcher = progress.set
        if call.stream:
            return StreamResponse(self._stream(request, words, writer, progress))
        try:
            while not request.finished:
                await progress.wait()
                progress.clear()
        finally:
            if not request.finished:
                self.runner.abort(request)
        text = "".join(tokenizer.token_text(word, index == 0 and chat)
                       for index, word in enumerate(words[: request.num_output]))
        return Response(200, writer.body(text, request.finish_reason, request.num_output,
                                         self._cached_tokens(request)))

    def _cached_tokens(self, request: Request) -> int | None:
        """What usage reports as ``prompt_tokens_details.cached_tokens`` for a finished
        ``request``: the prompt tokens its first admission found in the prefix cache, as vLLM's
        ``num_cached_tokens`` (None: ``--enable-prompt-tokens-details`` is off)."""
        return request.num_cached_tokens if self.settings.prompt_tokens_details else None

    def _submit(self, call: CompletionCall) -> tuple[Request, list[int]]:
        """Decide the output and queue the request; raises ApiError when the engine refuses."""
        max_model_len = self.settings.engine.profile.max_model_len
        if call.max_tokens is not None:
            count, reason = call.max_tokens, "length"
        else:
            median = self.settings.output_len_median
            drawn = round(self._output_rng.lognormvariate(math.log(median), 1.0))
            count, reason = max(1, min(drawn, max_model_len - len(call.prompt))), "stop"
        words = tokenizer.generate_words(count, self._output_rng.getrandbits(32))
        spec = RequestSpec(
            request_id=uuid.uuid4().hex,
            prompt=call.prompt,
            max_tokens=count,
            adapter=self._models[call.model],
            output=tuple(tokenizer.WORD_IDS[word] for word in words),
            finish_reason=reason,
        )
        try:
            return self.runner.submit(spec), words
        except UnknownAdapterError as error:
            raise ApiError(404, str(error)) from None
        except RequestRejected as error:
            raise ApiError(400, str(error)) from None

    async def _stream(
        self,
        request: Request,
        words: list[int],
        writer: ResponseWriter,
        progress: asyncio.Event,
    ) -> AsyncIterator[bytes]:
        chat = writer.call.chat
        sent = 0
        try:
            if chat:
                yield writer.role_chunk()
            while True:
                produced = request.num_output
                if produced > sent:
                    last = produced - 1 if request.finished else -1
                    yield b"".join(
                        writer.token_chunk(
                            tokenizer.token_text(words[index], index == 0 and chat),
                            request.finish_reason if index == last else None,
                        )
                        for index in range(sent, produced)
                    )
                    sent = produced
                if request.finished:
                    break
                await progress.wait()
                progress.clear()
            if writer.call.include_usage:
                yield writer.usage_chunk(request.num_output, self._cached_tokens(request))
            yield writer.done()
        finally:
            if not request.finished:
                self.runner.abort(request)

    async def _get_kv_event_fault(self, request: HttpRequest) -> Response:
        """Batches still to drop and the last sequence published, changing nothing."""
        if self.kv_events is None:
            return Response(409, b'{"detail":"KV-cache events are off"}')
        return Response(200, msgspec.json.encode({"drop": self.kv_events.drop_next,
                                                  "seq": self.kv_events.seq}))

    async def _set_kv_event_fault(self, request: HttpRequest) -> Response:
        if self.kv_events is None:
            return Response(409, b'{"detail":"KV-cache events are off"}')
        try:
            fault = msgspec.json.decode(request.body, type=KVEventFault)
        except msgspec.DecodeError as error:
            return Response(400, msgspec.json.encode({"detail": str(error)}))
        self.kv_events.drop_next = max(0, fault.drop)
        return await self._get_kv_event_fault(request)

    def _record_step(self, result: StepResult) -> None:
        events = self.engine.kv.events
        if events and self.kv_events is not None:
            self.kv_events.publish(events)
            self.engine.kv.events = []
        snapshot = self.engine.snapshot() if self.settings.engine.adapters else None
        self.metrics.record_step(result, snapshot)
