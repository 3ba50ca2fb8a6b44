"""The arrivals of a flight recording (``lig record``) as a benchmark trace.

A recording holds the pickers' decision records (``scheduling/record.py``) in DECISION frames
named ``records.<pool>``. Every :class:`~scheduling.record.DecisionRecord` of the chosen pool is
one arrival: its decision time, the model asked for and the target it resolved to, its
criticality and its token sizes:

- prompt tokens: the outcome's ``usage.prompt_tokens`` when the request's
  :class:`~scheduling.record.OutcomeRecord` carries it, else the picker's estimate;
- output tokens: the outcome's ``usage.completion_tokens``, else the request's ``max_tokens``,
  else :data:`DEFAULT_OUTPUT_TOKENS`.

Also read: how many pods the pool had (the most endpoints its recorded registry listed), which
targets are LoRA adapters (names the recorded pod views list as running or waiting adapters),
and the pods' adapter slots. The file is read by :func:`recording.records.read_records` (the
reader of ``lig replay --what-if`` and ``lig explain --recording``): messages that do not decode
are counted and skipped (the report gives the count and the first reason), not fatal.

What a trace cannot carry: prompt text (decision records hold only ``prefix_blocks`` and
``prefix_hits``, not the prefix hashes), so every prompt plays as text of its own;
:attr:`RecordedTrace.prefix_hit_decisions` says how many recorded decisions found a cached
prefix.
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from typing import BinaryIO

import msgspec

from recording.fileformat import RecordingError, read_header
from recording.records import ReadCounts, Registry, read_records
from scheduling.record import DecisionRecord, OutcomeRecord
from shared.errors import InputError
from shared.schemas import Criticality, EndpointSet
from shared.subjects import unescape_token

DEFAULT_OUTPUT_TOKENS = 129
"""Output tokens of a recorded request with neither usage nor ``max_tokens``: the median answer
of the Azure conversation trace, as the synthetic workloads draw."""

_ENDPOINTS = "endpoints."  # registry keys of endpoint sets
_endpoints_decoder = msgspec.msgpack.Decoder(EndpointSet)


class RecordedTraceError(InputError, ValueError):
    """A recording that cannot become a trace; the message is one line for the user."""


class RecordedArrival(msgspec.Struct, frozen=True, array_like=True):
    """One recorded request: seconds from the first decision, models, criticality, tokens."""

    time: float
    model: str
    target_model: str
    criticality: Criticality
    prompt_tokens: int
    output_tokens: int


class TokenSources(msgspec.Struct):
    """Where the arrivals' token counts came from."""

    prompt_usage: int = 0
    prompt_estimate: int = 0
    output_usage: int = 0
    output_max_tokens: int = 0
    output_default: int = 0


class RecordedTrace(msgspec.Struct, frozen=True):
    """The arrivals of one pool of a recording, and what the recording says of its fleet."""

    path: str
    pool: str
    arrivals: tuple[RecordedArrival, ...]
    endpoints: int
    """The most endpoints the pool's recorded registry listed (0: none recorded)."""
    view_pods: int
    """Distinct pods the recorded decisions saw."""
    adapters: tuple[str, ...]
    """Recorded target models that pods listed as LoRA adapters, most requested first."""
    max_lora: int
    """The most adapter slots a recorded pod view reported (0: none)."""
    pickers: int
    """Distinct picker ids that recorded decisions (a restarted picker counts again)."""
    sources: TokenSources
    prefix_hit_decisions: int
    """Decisions whose prefix index matched a pod: what the trace cannot reproduce."""
    recorded_sheds: int
    skipped: int
    """Record batches (a newer schema, a foreign message), decision records (values no picker
    records) and registry endpoint sets that did not decode, skipped."""
    first_skip: str = ""
    """Why the first of them was skipped (the report shows it: one line, not one per batch)."""

    @property
    def span(self) -> float:
        """Seconds from the first arrival to the last."""
        return self.arrivals[-1].time

    @property
    def rate(self) -> float:
        """The recorded mean rate in requests per second (one gap per pair of arrivals)."""
        return (len(self.arrivals) - 1) / self.span

    @property
    def pods(self) -> int:
        """The pod count the recording implies: its endpoints, else the pods decisions saw."""
        return self.endpoints or self.view_pods


class _Decision(msgspec.Struct, gc=False):
    """What the trace keeps of a decision record (not its view: a recorded hour holds millions),
    and its outcome's usage once that arrives."""

    time_ns: int
    model: str
    target_model: str
    criticality: Criticality
    estimate: int
    max_tokens: int
    prefix_hit: bool
    shed: bool
    prompt_usage: int | None = None
    completion_usage: int | None = None


class _Pool:
    """What one pass collects for one pool."""

    def __init__(self) -> None:
        self.decisions: list[_Decision] = []
        # Routed decisions waiting for their outcome, by (picker, decision number).
        self.open: dict[tuple[str, int], _Decision] = {}
        self.names: dict[str, str] = {}  # one string per model name, however often recorded
        self.endpoints = 0
        self.pods: set[str] = set()
        self.adapters: set[str] = set()
        self.max_lora = 0
        self.pickers: set[str] = set()

    def decided(self, picker: str, record: DecisionRecord) -> None:
        """Keep what the trace needs of ``record``; note the pods and adapters of its view."""
        names = self.names
        decision = _Decision(
            time_ns=record.time_ns,
            model=names.setdefault(record.model, record.model),
            target_model=names.setdefault(record.target_model, record.target_model),
            criticality=record.criticality, estimate=record.prompt_tokens,
            max_tokens=record.max_tokens, prefix_hit=bool(record.prefix_hits),
            shed=record.shed)
        self.decisions.append(decision)
        self.pickers.add(picker)
        if record.pick is not None:
            self.open[(picker, record.seq)] = decision
        for view in record.view:
            self.pods.add(view.name)
            self.adapters.update(view.running_adapters, view.waiting_adapters)
            self.max_lora = max(self.max_lora, view.max_lora)

    def ended(self, picker: str, outcome: OutcomeRecord) -> None:
        """The usage of a routed decision's outcome (an outcome without its decision is
        ignored: its decision was before the recorded window)."""
        decision = self.open.pop((picker, outcome.seq), None)
        if decision is not None:
            decision.prompt_usage = outcome.prompt_tokens
            decision.completion_usage = outcome.completion_tokens


def read_recorded_trace(path: str | Path, pool: str | None = None) -> RecordedTrace:
    """The trace of ``pool`` (default: the only pool with decision records) in the recording at
    ``path``; :class:`RecordedTraceError` or :class:`~recording.fileformat.RecordingError` (both
    ValueError, one line each) when it cannot be one."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as exc:
        raise RecordedTraceError(f"{path}: {exc.strerror or exc}") from None
    return _read(str(path), pool, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _read(path: str, pool: str | None, _mtime_ns: int, _size: int) -> RecordedTrace:
    # Cached per file version: every benchmark point of a sweep plays the same arrivals, and
    # the points of one worker process read the file once.
    try:
        with open(path, "rb") as source:
            read_header(source)
            pools, counts = _scan(source)
    except OSError as exc:
        raise RecordedTraceError(f"{path}: {exc.strerror or exc}") from None
    except RecordingError as exc:
        raise RecordingError(f"{path}: {exc}") from None
    with_records = sorted(name for name, found in pools.items() if found.decisions)
    if not with_records:
        raise RecordedTraceError(
            f"{path}: no decision records (recorded before the pickers published them, or "
            "recording was off)")
    if pool is None:
        if len(with_records) > 1:
            raise RecordedTraceError(
                f"{path}: records of several pools ({', '.join(with_records)}): pass --pool")
        pool = with_records[0]
    if pool not in with_records:
        raise RecordedTraceError(f"{path}: no decision records of pool {pool!r} "
                                 f"(pools with records: {', '.join(with_records)})")
    return _trace(path, pool, pools[pool], counts)


class _Endpoints(Registry):
    """The recorded registry, noting the most endpoints each pool's set listed."""

    def __init__(self, counts: ReadCounts) -> None:
        super().__init__()
        self.counts = counts
        self.most: dict[str, int] = {}  # pool -> the most endpoints its set listed

    def apply(self, key: str, data: bytes | None, time_ns: int = 0) -> None:
        """:meth:`Registry.apply`, and an endpoint set's size noted (skipped if undecodable)."""
        super().apply(key, data, time_ns)
        if data is None or not key.startswith(_ENDPOINTS):
            return
        try:
            members = len(_endpoints_decoder.decode(data).endpoints)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.counts.skip("registry key %s does not decode as an EndpointSet: %s", key, exc)
            return
        pool = unescape_token(key[len(_ENDPOINTS):])
        self.most[pool] = max(self.most.get(pool, 0), members)


def _scan(source: BinaryIO) -> tuple[dict[str, _Pool], ReadCounts]:
    """One pass over the body: per pool its decisions, outcomes, endpoints and views."""
    pools: dict[str, _Pool] = {}
    counts = ReadCounts()
    registry = _Endpoints(counts)
    for item in read_records(source, registry, counts):
        found = pools.get(item.pool)
        if found is None:
            found = pools[item.pool] = _Pool()
        record = item.record
        if isinstance(record, DecisionRecord):
            found.decided(item.picker, record)
        else:
            found.ended(item.picker, record)
    for pool, members in registry.most.items():
        pools.setdefault(pool, _Pool()).endpoints = members
    return pools, counts


def _trace(path: str, pool: str, found: _Pool, counts: ReadCounts) -> RecordedTrace:
    decisions = found.decisions
    decisions.sort(key=lambda decision: decision.time_ns)
    if len(decisions) < 2 or decisions[-1].time_ns <= decisions[0].time_ns:
        raise RecordedTraceError(
            f"{path}: pool {pool!r} has {len(decisions)} decision record(s) at "
            f"{len({decision.time_ns for decision in decisions})} distinct time(s): a trace "
            "needs at least two arrivals at different times to define a rate")
    start = decisions[0].time_ns
    sources = TokenSources()
    arrivals = []
    targets: Counter[str] = Counter()
    for decision in decisions:
        targets[decision.target_model] += 1
        arrivals.append(RecordedArrival(
            time=(decision.time_ns - start) / 1e9,
            model=decision.model,
            target_model=decision.target_model,
            criticality=decision.criticality,
            prompt_tokens=_prompt_tokens(decision, sources),
            output_tokens=_output_tokens(decision, sources),
        ))
    adapters = tuple(sorted((name for name in targets if name in found.adapters),
                            key=lambda name: (-targets[name], name)))
    return RecordedTrace(
        path=path,
        pool=pool,
        arrivals=tuple(arrivals),
        endpoints=found.endpoints,
        view_pods=len(found.pods),
        adapters=adapters,
        max_lora=found.max_lora,
        pickers=len(found.pickers),
        sources=sources,
        prefix_hit_decisions=sum(1 for decision in decisions if decision.prefix_hit),
        recorded_sheds=sum(1 for decision in decisions if decision.shed),
        skipped=counts.undecodable,
        first_skip=counts.first_skip,
    )


def _prompt_tokens(decision: _Decision, sources: TokenSources) -> int:
    if decision.prompt_usage is not None:
        sources.prompt_usage += 1
        return max(1, decision.prompt_usage)
    sources.prompt_estimate += 1
    return max(1, decision.estimate)  # the engine computes at least one token


def _output_tokens(decision: _Decision, sources: TokenSources) -> int:
    if decision.completion_usage is not None:
        sources.output_usage += 1
        return max(1, decision.completion_usage)
    if decision.max_tokens > 0:
        sources.output_max_tokens += 1
        return decision.max_tokens
    sources.output_default += 1
    return DEFAULT_OUTPUT_TOKENS


def describe(trace: RecordedTrace) -> str:
    """What the trace holds and what it cannot reproduce, for the report (markdown lines)."""
    count = len(trace.arrivals)
    sources = trace.sources
    lines = [
        f"Recording `{trace.path}`, pool `{trace.pool}`: {count} arrivals over "
        f"{trace.span:.3f} s ({trace.rate:.3g} req/s recorded) by {trace.pickers} picker(s) "
        f"(--pickers sets the simulated replicas); {trace.endpoints} recorded endpoints, "
        f"{trace.view_pods} pods seen in decisions; "
        f"{len({arrival.model for arrival in trace.arrivals})} requested model(s) resolved to "
        f"{len({arrival.target_model for arrival in trace.arrivals})} target(s) as recorded, "
        f"{len(trace.adapters)} of them LoRA adapters; {trace.recorded_sheds} recorded sheds.",
        f"Prompt tokens: {sources.prompt_usage} from usage, {sources.prompt_estimate} from the "
        f"picker's estimate. Output tokens: {sources.output_usage} from usage, "
        f"{sources.output_max_tokens} from max_tokens, {sources.output_default} the default "
        f"{DEFAULT_OUTPUT_TOKENS}.",
        f"Not reproduced: prompt text and shared prefixes ({trace.prefix_hit_decisions} of "
        f"{count} recorded decisions had prefix-cache hits; every prompt plays as unique text).",
    ]
    if trace.skipped:
        lines.append(f"Skipped {trace.skipped} undecodable message(s); first: {trace.first_skip}.")
    return "\n".join(lines)
