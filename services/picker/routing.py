"""Deciding where one request goes: read the body, resolve the model, run the pool's policy.

Pure logic (no network): :class:`Router` turns a request body into either a :class:`Routed`
(destination, rewritten body) or a :class:`Rejected` (HTTP status and OpenAI-shaped error body).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType

import msgspec

from scheduling import PolicyConfigError, build_policy
from scheduling.precise_index import DEFAULT_RECOVERY_S, DEFAULT_SPECULATIVE_TTL, PreciseIndex
from scheduling.prefix_hash import prefix_hashes
from scheduling.prefix_index import PrefixIndex
from scheduling.prompt import (
    BLOCK_TOKENS,
    CompletionPrompt,
    Message,
    PromptDigest,
    chat_prompt,
    completion_prompt,
)
from scheduling.record import DecisionRecord, Record
from scheduling.token_blocks import PromptTokenizer, block_keys, root_key
from scheduling.types import Decision, PodView, Policy, SchedulingRequest
from services.picker.load_estimate import prefill_tokens
from services.picker.state import PodTable
from shared.logs import RateLimitedLog
from shared.registry_view import RegistryChanges, RegistryView
from shared.schemas import (
    Criticality,
    DecisionEvent,
    Endpoint,
    InferenceModel,
    InferencePool,
    PolicyConfig,
    ShedEvent,
)

log = logging.getLogger("lig.picker.routing")


class ModelField(msgspec.Struct):
    """The one body field every request needs; everything else is skipped while decoding.

    (Whether a response streams is read from its content-type, not from ``stream``.)
    """

    model: str | None = None


class RequestFields(ModelField):
    """``model`` and what scheduling reads of the prompt (``scheduling/prompt.py``): the
    completions ``prompt``, the chat ``messages`` and the completion limit."""

    prompt: CompletionPrompt | None = None
    messages: list[Message] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None

    def digest(self) -> PromptDigest:
        """The prompt's token estimate and the bytes to hash (chat messages first)."""
        if self.messages is not None:
            return chat_prompt(self.messages)
        return completion_prompt(self.prompt)

    def completion_limit(self) -> int:
        """``max_completion_tokens`` (the chat API's newer name), else ``max_tokens``; 0: none."""
        limit = self.max_completion_tokens
        if limit is None:
            limit = self.max_tokens
        if limit is None or limit <= 0:
            return 0
        # JSON integers are unbounded; events carrying this must fit 64-bit encodings.
        return min(limit, MAX_COMPLETION_LIMIT)


MAX_COMPLETION_LIMIT = 2**31 - 1

_decode_fields = msgspec.json.Decoder(RequestFields).decode
_decode_model = msgspec.json.Decoder(ModelField).decode
# Top-level members kept as raw bytes: a rewrite re-encodes only ``model``, so whatever the
# client put elsewhere (numbers beyond float range, any nesting msgspec can skip) passes through
# byte for byte, as it does for a request that is not rewritten.
_decode_members = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_NO_HITS: Mapping[str, int] = MappingProxyType({})  # requests without prefix hashes
_BOM = b"\xef\xbb\xbf"  # RFC 8259 lets a parser ignore it; Python's json (vLLM's) does


class Routed(msgspec.Struct, frozen=True):
    """Send the request to ``endpoint`` (``ip:port``), with ``body`` replacing it when not None;
    ``fallbacks`` are the next endpoints to try, in policy order (endpoint picker protocol);
    ``request_id`` numbers the router's decisions (the decision stream's event id)."""

    pod: str
    endpoint: str
    model: str
    target_model: str
    registered: bool
    body: bytes | None = None
    fallbacks: tuple[str, ...] = ()
    pool: str = ""  # the pool whose pod was chosen
    prompt_tokens: int = 0  # estimated (scheduling/prompt.py), for the load estimate
    max_tokens: int = 0  # the client's completion limit, 0 when none
    prefix_hashes: tuple[int, ...] = ()  # chained block hashes, for the decision stream
    criticality: Criticality = Criticality.STANDARD
    request_id: int = 0
    envoy_request_id: str = ""  # Envoy's x-request-id ("" when none), for the outcome record
    decided_ns: int = 0  # perf_counter_ns of the decision (recording on), for the outcome record
    # The prefix matches the decision used (per pod, leading blocks held, of prefix_blocks
    # looked up, each of at most block_tokens tokens), for the tokens each pod must prefill.
    prefix_hits: Mapping[str, int] = _NO_HITS
    prefix_blocks: int = 0
    block_tokens: int = 0

    def prefill_on(self, pod: str) -> int:
        """The prompt tokens ``pod`` must compute for this request: its estimate minus what the
        decision's prefix index says ``pod`` caches (``load_estimate.prefill_tokens``)."""
        return prefill_tokens(self.prompt_tokens, self.prefix_hits.get(pod, 0),
                              self.prefix_blocks, self.block_tokens)

    def cached_on(self, pod: str) -> int:
        """The prompt tokens the decision's prefix index expects ``pod`` to find cached (what
        it need not compute), to compare with the ``cached_tokens`` the pod reports."""
        return self.prompt_tokens - self.prefill_on(pod)


class Rejected(msgspec.Struct, frozen=True):
    """Answer the client directly with ``status`` and the JSON error ``body``."""

    status: int
    outcome: str
    body: bytes
    model: str = ""
    target_model: str = ""
    registered: bool = False
    pool: str = ""  # the pool the model resolved to ("" when none)


class Answered(Rejected, frozen=True):
    """A direct answer that is not an error (``GET /v1/models``): same fields, status 2xx."""


class _ErrorDetail(msgspec.Struct):
    message: str
    type: str
    code: str


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail


_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


def error_body(status: int, message: str, code: str) -> bytes:
    """The OpenAI error shape: ``{"error": {"message", "type", "code"}}``."""
    return msgspec.json.encode(_ErrorBody(_ErrorDetail(message, _ERROR_TYPES[status], code)))


def reject(status: int, message: str, code: str, model: str = "") -> Rejected:
    """A :class:`Rejected` whose outcome label is the status code."""
    return Rejected(status, str(status), error_body(status, message, code), model, model)


class ModelRoute(msgspec.Struct, frozen=True):
    """A registered model name: its criticality and the weighted targets to draw from."""

    criticality: Criticality
    targets: tuple[str, ...]
    cumulative: tuple[int, ...]  # running totals of the weights, for a bisect draw

    @classmethod
    def of(cls, model: InferenceModel) -> ModelRoute:
        """Precompute the draw table of ``model`` (no targets: the name itself)."""
        targets = model.target_models
        if not targets:
            return cls(model.criticality, (model.model_name,), (1,))
        weights = [max(0, target.weight) for target in targets]
        if sum(weights) == 0:  # all weights zero: split evenly rather than refuse
            weights = [1] * len(weights)
        cumulative: list[int] = []
        total = 0
        for weight in weights:
            total += weight
            cumulative.append(total)
        return cls(model.criticality, tuple(t.name for t in targets), tuple(cumulative))

    def draw(self, rng: random.Random) -> str:
        """A target chosen with probability proportional to its weight."""
        if len(self.targets) == 1:
            return self.targets[0]
        point = rng.randrange(self.cumulative[-1])
        return self.targets[bisect.bisect_right(self.cumulative, point)]


DecisionCallback = Callable[[str, DecisionEvent], None]
"""Receives each decision a picker makes (pool, event): the decision stream's publisher."""

RecordCallback = Callable[[str, Record], None]
"""Receives the flight recorder's records (pool, record): the record publisher."""

_NO_HIT_RECORD: dict[str, int] = {}  # the record of a request without prefix matches (shared)


DEFAULT_PREFIX_ENTRIES = 65_536  # ~200 bytes each (bench/bench_prefix.py): ~13 MiB a pool
DEFAULT_PRECISE_BLOCKS = 500_000  # ~165 bytes each (bench/bench_precise_index.py): ~80 MB a pool
MAX_PRECISE_KEYS = 2048  # token blocks of a prompt looked up (32,768 tokens of 16), bounding cost


class Router:
    """Routes the requests of one pool, from the registry state and the pod table.

    ``prefixes`` is the pool's approximate prefix index (``scheduling/prefix_index.py``) of at
    most ``prefix_entries`` block hashes: every routed prompt is recorded for its pod, and every
    request's prefix matches are handed to the policy (``SchedulingRequest.prefix_hits``).
    ``precise`` is the pool's precise index (``scheduling/precise_index.py``, at most
    ``precise_blocks`` blocks, 0: off), fed with the pods' KV-cache events; it is used when the
    pool has a ``tokenizer`` and some pods publish events (see :meth:`_request`).
    ``on_decision`` hears of every request this router sheds (routed and finished requests are
    reported by the :class:`~services.picker.pools.Gateway`, which sees them start and end).

    ``on_record`` (None: recording off) gets a :class:`~scheduling.record.DecisionRecord` of
    every scheduled request: routed, shed, or refused for want of a pod. With it on, every
    decision draws a 64-bit ``draw`` from a random source of its own and seeds the policy's
    random source with it just before the policy runs, so that the recorded view, request and
    draw give the same pick again (docs/recording.md, "Decision records").

    ``clock`` times speculative blocks (virtual time in the benchmark).
    """

    def __init__(self, pool: str, pods: PodTable, rng: random.Random,
                 on_all_stale: Callable[[], None] = lambda: None, fallbacks: int = 0,
                 prefix_entries: int = DEFAULT_PREFIX_ENTRIES,
                 precise_blocks: int = DEFAULT_PRECISE_BLOCKS,
                 speculative_ttl: float = DEFAULT_SPECULATIVE_TTL,
                 clock: Callable[[], float] = time.monotonic,
                 precise_recovery_s: float = DEFAULT_RECOVERY_S) -> None:
        self.pool_name = pool
        self.fallbacks = fallbacks
        self.pods = pods
        self.prefixes = PrefixIndex(prefix_entries)
        self.precise = PreciseIndex(precise_blocks, speculative_ttl, clock=clock,
                                    recovery_s=precise_recovery_s)
        self.tokenizer: PromptTokenizer | None = None
        """The pool's tokenizer (set by whoever configures tokenizers; None: approximate)."""
        self._clock = clock
        self._without_tokenizer_logged = False
        self._tokenizer_errors = RateLimitedLog(log)
        self._rng = rng
        self._pool: InferencePool | None = None
        self._models: dict[str, ModelRoute] = {}
        self._policy_config = PolicyConfig()
        self._policy: Policy = build_policy(self._policy_config, rng)
        self._on_all_stale = on_all_stale
        self._all_stale_log = RateLimitedLog(log)
        self._quoted_pool = msgspec.json.encode(pool).decode()
        self.on_decision: DecisionCallback | None = None
        self.on_record: RecordCallback | None = None
        self._draws: random.Random | None = None  # the draw source, made when first recording
        self._next_id = itertools.count(1).__next__

    @property
    def policy(self) -> Policy:
        """The policy in use (rebuilt when the pool's policy configuration changes)."""
        return self._policy

    def update(self, view: RegistryView, changes: RegistryChanges | None = None) -> None:
        """Take this pool's definition, models and endpoints from the registry view: all of
        them, or (given ``changes``) only those that changed, so that the cost of an update
        follows the size of the change, not of the registry."""
        name = self.pool_name
        if changes is None:
            changes = RegistryChanges(everything=True)
        everything = changes.everything
        if everything or name in changes.pools:
            self._take_pool(view.pools.get(name))
        models = view.models.get(name, {})
        if everything:
            self._models = {model: ModelRoute.of(entry) for model, entry in models.items()}
        else:
            for model in changes.models.get(name, ()):
                entry = models.get(model)
                if entry is None:
                    self._models.pop(model, None)
                else:
                    self._models[model] = ModelRoute.of(entry)
        if everything or name in changes.endpoints:
            endpoint_set = view.endpoints.get(name)
            before = {endpoint.name for endpoint in self.pods.endpoints}
            self.pods.set_endpoints(endpoint_set.endpoints if endpoint_set is not None else ())
            members = {endpoint.name for endpoint in self.pods.endpoints}
            for gone in before.difference(members):
                self.prefixes.forget(gone)
            # Every non-member, not only those that just left: changes applied before the
            # registry was read (a replayed recording) may name pods long gone.
            for stranger in set(self.precise.pods()).difference(members):
                self.precise.forget(stranger)

    def _take_pool(self, pool: InferencePool | None) -> None:
        self._pool = pool
        config = pool.policy if pool is not None else PolicyConfig()
        if config != self._policy_config:
            try:
                self._policy = build_policy(config, self._rng)
            except PolicyConfigError as exc:
                log.error("pool %s: invalid policy %r (%s); keeping policy %s",
                          self.pool_name, config.name, exc, self._policy.name)
            else:
                log.info("pool %s: using policy %s", self.pool_name, config.name)
            self._policy_config = config

    def _objective_criticality(self, objective: str, otherwise: Criticality) -> Criticality:
        """The criticality an objective header gives: the pool's InferenceObjective of that
        name, else a registered model of that name, else ``otherwise`` (unknown: ignored)."""
        if self._pool is not None and objective in self._pool.objectives:
            return self._pool.objectives[objective]
        named = self._models.get(objective)
        return named.criticality if named is not None else otherwise

    def route(self, body: bytes, subset: frozenset[str] | None = None,
              objective: str | None = None, request_id: str = "") -> Routed | Rejected:
        """Decide where a request with this JSON ``body`` goes.

        ``subset``: the gateway's subset hint (``ip:port`` set; None: every member); only its
        members may be picked. ``objective``: the InferenceObjective header: an objective of the
        pool, or a registered model of it, whose criticality applies instead of the requested
        model's (an unknown name is ignored). ``request_id``: Envoy's ``x-request-id``, for the
        decision record. Every client mistake in ``body`` is a 400 :class:`Rejected` (never an
        exception).
        """
        fields = read_request(body)
        if isinstance(fields, Rejected):
            return fields
        return self.route_model(body, fields.model or "", subset, objective, fields, request_id)

    def serves(self, model: str) -> bool:
        """Whether ``model`` is registered in this pool."""
        return model in self._models

    @property
    def models(self) -> Iterable[str]:
        """The model names registered in this pool."""
        return self._models.keys()

    def route_model(self, body: bytes, requested: str, subset: frozenset[str] | None = None,
                    objective: str | None = None, fields: RequestFields | None = None,
                    request_id: str = "") -> Routed | Rejected:
        """Route a request for ``requested`` (read from ``body`` by :func:`requested_model`)
        over this pool's pods; ``subset``, ``objective`` and ``request_id`` as :meth:`route`
        takes them; ``fields``: ``body`` already read by :func:`read_request` (read here when
        None)."""
        route = self._models.get(requested)
        pool = self.pool_name
        if route is None:
            if self._pool is not None and self._pool.reject_unknown_models:
                quoted = msgspec.json.encode(requested).decode()
                rejected = reject(404, f"model {quoted} is not served by pool "
                                  f"{self._quoted_pool}", "model_not_found", requested)
                return msgspec.structs.replace(rejected, pool=pool)
            target, criticality = requested, Criticality.STANDARD
        else:
            target, criticality = route.draw(self._rng), route.criticality
        if objective is not None:
            criticality = self._objective_criticality(objective, criticality)
        registered = route is not None
        request, hashes, keys, block_tokens = self._request(body, requested, target,
                                                            criticality, fields)
        seq = self._next_id()
        choice = self._choose(request, subset, seq, request_id)
        if isinstance(choice, Rejected):
            return Rejected(choice.status, choice.outcome, choice.body, requested, target,
                            registered, pool)
        pick, fallbacks = choice
        new_body: bytes | None = None
        if target != requested:
            rewritten = rewrite_model(body, target)
            if isinstance(rewritten, Rejected):
                return Rejected(rewritten.status, rewritten.outcome, rewritten.body, requested,
                                target, registered, pool)
            new_body = rewritten
        # Only a request that reaches the pod leaves its prompt in the pod's cache.
        if hashes:
            self.prefixes.record(pick.name, hashes)
        if keys and self.precise.has_events(pick.name):
            self.precise.speculate(pick.name, keys, self._clock())
        return Routed(pick.name, pick.address, requested, target, registered, new_body,
                      fallbacks, pool, request.prompt_tokens, request.max_tokens, hashes,
                      criticality, seq, request_id,
                      time.perf_counter_ns() if self.on_record is not None else 0,
                      request.prefix_hits, len(request.prefix_hashes), block_tokens)

    def _request(self, body: bytes, requested: str, target: str, criticality: Criticality,
                 fields: RequestFields | None
                 ) -> tuple[SchedulingRequest, tuple[int, ...], list[int], int]:
        """The request as the policy sees it (prompt estimate, prefix blocks and their matches),
        with the prompt's approximate hashes, its token-block keys (empty when not used) and the
        most tokens one of the request's blocks holds.

        Precise scoring applies when the pool has a tokenizer that can tokenize this prompt and
        some pods publish KV events: the request's blocks are then token blocks, the hits of the
        pods with events come from the precise index, and those of the other pods from the
        approximate index, rescaled to token blocks (a fraction of the prompt either way, which
        is what the prefix scorer compares). A pod whose precise state is incomplete gets the
        better of its precise and approximate counts."""
        if fields is None:
            read = read_request(body)
            fields = read if isinstance(read, RequestFields) else RequestFields()
        digest = fields.digest()
        hashes = prefix_hashes(digest.data, target) if digest.data else ()
        hits = self.prefixes.match(hashes) if hashes else _NO_HITS
        keys = self._token_keys(fields, target)
        if not keys:
            return (SchedulingRequest(requested, target, criticality, digest.tokens,
                                      fields.completion_limit(), hashes, hits),
                    hashes, keys, BLOCK_TOKENS)
        precise = self.precise
        publishing = precise.event_pods()
        merged = {pod: depth for pod, depth in precise.match(keys).items() if pod in publishing}
        # Pods whose precise state is incomplete (events lost, a resync) get the better of both.
        incomplete = precise.incomplete_pods()
        if hits:
            scale = len(keys) / len(hashes)
            for pod, depth in hits.items():
                if pod not in publishing or pod in incomplete:
                    merged[pod] = max(merged.get(pod, 0), min(len(keys), int(depth * scale)))
        return (SchedulingRequest(requested, target, criticality, digest.tokens,
                                  fields.completion_limit(), tuple(keys), merged),
                hashes, keys, precise.block_size or BLOCK_TOKENS)

    def _token_keys(self, fields: RequestFields, target: str) -> list[int]:
        """The keys of the prompt's token blocks, or [] when precise scoring does not apply.

        The chain's root is the adapter's when ``target`` is an adapter the pods' events named
        (an adapter not seen in any event yet has no cached block to find), else the base
        model's."""
        precise = self.precise
        if not precise.event_pods() or not precise.max_blocks:
            return []
        tokenizer = self.tokenizer
        if tokenizer is None:
            if not self._without_tokenizer_logged:
                self._without_tokenizer_logged = True
                log.info("pool %s: pods publish KV events but the pool has no tokenizer; prefix "
                         "scoring uses the approximate index", self.pool_name)
            return []
        block_size = precise.block_size
        if block_size is None:
            return []
        try:
            ids = tokenizer.prompt_token_ids(fields.prompt, fields.messages)
            if not ids:
                return []
            return block_keys(ids, block_size,
                              root_key(target if target in precise.lora_names else None),
                              MAX_PRECISE_KEYS)
        except Exception as exc:  # a tokenizer's failure must not fail the request
            self._tokenizer_errors.warning(
                "pool %s: the tokenizer failed (%s: %s); approximate prefix index for this "
                "request", self.pool_name, type(exc).__name__, exc)
            return []

    def route_bodiless(self, subset: frozenset[str] | None = None) -> Routed | Rejected:
        """Route a request without a body (e.g. ``GET /v1/models``) to any ready pod (of the
        ``subset`` hint, when given)."""
        fresh = _in_subset(self.pods.fresh_views(), subset)
        if fresh:
            pick = fresh[self._rng.randrange(len(fresh))]
            return Routed(pick.name, pick.address, "", "", False, pool=self.pool_name,
                          request_id=self._next_id())
        endpoints = self._members_in(subset)
        if not endpoints:
            return self._no_endpoint() if subset is None else self._none_in_subset()
        endpoint = endpoints[self._rng.randrange(len(endpoints))]
        return Routed(endpoint.name, endpoint.hostport, "", "", False, pool=self.pool_name,
                      request_id=self._next_id())

    def _choose(self, request: SchedulingRequest, subset: frozenset[str] | None, seq: int,
                request_id: str) -> tuple[PodView, tuple[str, ...]] | Rejected:
        pods = _in_subset(self.pods.fresh_views(), subset)
        record = self.on_record
        if not pods:
            chosen = self._any_endpoint(subset)
            if record is not None:  # no policy ran: an empty view and no draw
                record(self.pool_name, self._record(
                    request, seq, request_id, 0, pods,
                    None if isinstance(chosen, Rejected) else chosen.name, False, ()))
            return chosen if isinstance(chosen, Rejected) else (chosen, ())
        draw = 0
        if record is not None:
            draws = self._draws
            if draws is None:
                draws = self._draws = random.Random(self._rng.getrandbits(64))
            draw = draws.getrandbits(64)
            self._rng.seed(draw)  # the policy's random source: the draw decides every choice
        explain = log.isEnabledFor(logging.DEBUG)
        decision = self._policy.schedule(request, pods, explain=explain)
        if explain:
            _log_decision(self.pool_name, request, decision)
        if decision.pick is not None:
            fallbacks = self._fallbacks(request, pods, decision)
            if record is not None:
                record(self.pool_name, self._record(request, seq, request_id, draw, pods,
                                                    decision.pick.name, False, fallbacks))
            return decision.pick, fallbacks
        if record is not None:
            record(self.pool_name, self._record(request, seq, request_id, draw, pods, None,
                                                decision.shed, ()))
        if decision.shed:
            if self.on_decision is not None:
                self.on_decision(self.pool_name, ShedEvent(
                    seq, request.target_model, request.criticality))
            return reject(429, f"pool {self._quoted_pool} is saturated; sheddable request "
                          "dropped", "pool_saturated")
        return reject(503, f"no pod of pool {self._quoted_pool} can take the request",
                      "no_ready_endpoint")

    def _record(self, request: SchedulingRequest, seq: int, request_id: str, draw: int,
                view: Sequence[PodView], pick: str | None, shed: bool,
                fallbacks: tuple[str, ...]) -> DecisionRecord:
        """The decision's record, built from what exists already (the view list is the one the
        policy ran on, not a copy)."""
        hits = request.prefix_hits
        return DecisionRecord(
            request_id, seq, time.time_ns(), request.model, request.target_model,
            request.criticality, request.prompt_tokens, request.max_tokens,
            len(request.prefix_hashes), hits if isinstance(hits, dict) else _NO_HIT_RECORD,
            self._policy.name, draw, view, pick, shed, fallbacks)  # type: ignore[arg-type]

    def _fallbacks(self, request: SchedulingRequest, pods: Sequence[PodView],
                   decision: Decision) -> tuple[str, ...]:
        """Up to ``self.fallbacks`` endpoints after the pick, in policy order: the policy runs
        again over the pods not yet listed, so each fallback is the next-best decision (under
        ``filter-tree`` the pick's fellow survivors usually come first, as they still pass)."""
        wanted = self.fallbacks
        if wanted <= 0 or decision.pick is None:
            return ()
        listed = {decision.pick.name}
        order: list[str] = []
        while len(order) < wanted:
            rest = [pod for pod in pods if pod.name not in listed]
            if not rest:
                break
            pick = self._policy.schedule(request, rest).pick
            if pick is None:  # the rest would shed this request or cannot take it
                break
            listed.add(pick.name)
            order.append(pick.address)
        return tuple(order)

    def _members_in(self, subset: frozenset[str] | None) -> Sequence[Endpoint]:
        """The members in the subset hint (all of them without a hint)."""
        endpoints = self.pods.endpoints
        if subset is None:
            return endpoints
        return [endpoint for endpoint in endpoints if endpoint.hostport in subset]

    def _none_in_subset(self) -> Rejected:
        return reject(503, f"no endpoint of the gateway's subset hint is eligible in pool "
                      f"{self._quoted_pool}", "no_eligible_endpoint_in_subset")

    def _any_endpoint(self, subset: frozenset[str] | None = None) -> PodView | Rejected:
        """Every member is stale (or none reported yet): pick uniformly among the members."""
        endpoints = self._members_in(subset)
        if not endpoints:
            # Members, but none in the subset hint: that is the hint's fault, not the pool's.
            return (self._none_in_subset() if subset is not None and self.pods.endpoints
                    else self._no_endpoint())
        self._on_all_stale()
        self._all_stale_log.warning(
            "pool %s: no fresh metrics for any of %d pods; picking uniformly at random",
            self.pool_name, len(endpoints))
        endpoint = endpoints[self._rng.randrange(len(endpoints))]
        return PodView(endpoint.name, endpoint.hostport)

    def _no_endpoint(self) -> Rejected:
        return reject(503, f"pool {self._quoted_pool} has no ready endpoint",
                      "no_ready_endpoint")


def _in_subset(pods: list[PodView], subset: frozenset[str] | None) -> list[PodView]:
    """``pods`` whose ``ip:port`` is in the subset hint (all of them without a hint)."""
    if subset is None:
        return pods
    return [pod for pod in pods if pod.address in subset]


def requested_model(body: bytes) -> str | Rejected:
    """The ``model`` a request body asks for, or the 400 answering a malformed body."""
    fields = read_request(body)
    return fields if isinstance(fields, Rejected) else fields.model or ""


def read_request(body: bytes) -> RequestFields | Rejected:
    """The fields the picker reads from ``body`` (``model`` always set), or the 400 answering a
    malformed body.

    Prompt fields of an unexpected shape (``"messages": 5``, a content part whose ``text`` is
    not a string) are not the picker's to refuse: the body is routed on its ``model`` alone, with
    no prompt estimate, as before the picker read prompts, and the model server answers it.
    """
    if body.startswith(_BOM):
        body = body[len(_BOM):]
    fields: RequestFields | Rejected
    try:
        fields = _decode_fields(body)
    except msgspec.ValidationError:
        fields = _model_only(body)
    except msgspec.DecodeError:
        return reject(400, "request body is not valid JSON", "invalid_json")
    except RecursionError:
        return _too_deep()
    if isinstance(fields, Rejected):
        return fields
    if fields.model is None:
        return reject(400, 'request body has no "model" field', "missing_model")
    return fields


def _model_only(body: bytes) -> RequestFields | Rejected:
    """Read ``model`` alone from a body whose prompt fields did not fit :class:`RequestFields`.

    The JSON may still be malformed after the field that did not fit (the first decode stopped
    there): that is the 400 ``invalid_json``, not an exception out of the router."""
    try:
        model = _decode_model(body).model
    except msgspec.ValidationError as exc:  # a subclass of DecodeError: first
        return reject(400, f"invalid request body: {exc}", "invalid_request")
    except msgspec.DecodeError:
        return reject(400, "request body is not valid JSON", "invalid_json")
    except RecursionError:
        return _too_deep()
    return RequestFields(model=model)


def _too_deep() -> Rejected:
    return reject(400, "request body nests JSON arrays or objects too deeply", "json_too_deep")


def rewrite_model(body: bytes, target: str) -> bytes | Rejected:
    """``body`` with its top-level ``model`` replaced by ``target``; other members are kept in
    order and byte for byte (a duplicated key keeps its last value, as Python's json reads it).

    A 400 :class:`Rejected` when the top level cannot be split into members (a top-level key
    that is not UTF-8, say).
    """
    if body.startswith(_BOM):
        body = body[len(_BOM):]
    try:
        members = _decode_members(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return reject(400, "request body is not valid JSON (keys must be UTF-8 strings)",
                      "invalid_json")
    except RecursionError:
        return _too_deep()
    members["model"] = msgspec.Raw(msgspec.json.encode(target))
    return msgspec.json.encode(members)


def _log_decision(pool: str, request: SchedulingRequest, decision: Decision) -> None:
    steps: Sequence[str] = [
        f"{step.step}: {len(step.entered)}->{len(step.kept)} [{step.branch}]"
        for step in decision.steps
    ]
    log.debug("decision pool=%s model=%s target=%s criticality=%s pick=%s shed=%s steps=%s",
              pool, request.model, request.target_model, request.criticality.value,
              decision.pick.name if decision.pick else None, decision.shed, "; ".join(steps))
