"""Recording files with flight records made by real policies on random views.

Each decision is made the way a recording picker makes it (the draw contract of
``recording/rerun.py``: one ``random.Random()`` per policy, seeded with the record's draw), so a
what-if with the recorded policy must reproduce every pick. Used by the tests and by
``bench/bench_whatif.py``.
"""

from __future__ import annotations

import random
from pathlib import Path

import msgspec

from recording.fileformat import Entry, FileHeader, Kind, Writer
from scheduling import PodView, Policy, SchedulingRequest, build_policy
from scheduling.record import DecisionRecord, OutcomeRecord, Record, RecordBatch
from shared.schemas import (
    Criticality,
    Endpoint,
    EndpointSet,
    InferencePool,
    PodMetrics,
    PolicyConfig,
    encode,
)
from shared.subjects import endpoints_key, escape_token, pool_key

SECOND = 1_000_000_000
START_NS = 1_764_547_200 * SECOND  # 2025-12-01T00:00:00Z
ADAPTERS = ("sql-lora", "chat-lora", "code-lora", "math-lora")
CRITICALITIES = (Criticality.CRITICAL, Criticality.STANDARD, Criticality.SHEDDABLE)


class Spec(msgspec.Struct, frozen=True):
    """What to record: ``changes`` maps a decision index to the pool's policy from then (its
    registry key is rewritten even when the policy stays the same)."""

    decisions: int
    pods: int = 8
    pool: str = "chat"
    policy: PolicyConfig = PolicyConfig()
    pickers: tuple[str, ...] = ("picker-a", "picker-b")
    changes: dict[int, PolicyConfig] = {}
    batch: int = 8  # records per RecordBatch
    seed: int = 1
    snapshots_every: int = 4  # a snapshot and a decision-stream message per N decisions


def random_view(rng: random.Random, pods: int) -> tuple[PodView, ...]:
    """``pods`` pods with random load, some saturated, adapters on some; one view in five is
    of a saturated fleet (where the filter tree sheds Sheddable requests)."""
    saturated = rng.random() < 0.2
    views = []
    for index in range(pods):
        busy = rng.random() < (0.97 if saturated else 0.3)
        adapters = frozenset(rng.sample(ADAPTERS, rng.randint(0, 2)))
        views.append(PodView(
            name=f"pod-{index}", address=f"10.0.0.{index}:8000",
            waiting=rng.randint(5, 60) if busy else rng.randint(0, 4),
            running=rng.randint(0, 32),
            kv_cache_usage=rng.uniform(0.7, 1.0) if busy else rng.uniform(0.0, 0.7),
            running_adapters=adapters,
            waiting_adapters=frozenset(rng.sample(ADAPTERS, rng.randint(0, 1))),
            max_lora=4, in_flight=rng.randint(0, 6),
            unreported_tokens=rng.randint(0, 4000)))
    rng.shuffle(views)
    return tuple(views)


def random_record(rng: random.Random, index: int, time_ns: int, policy: str,
                  views: tuple[PodView, ...]) -> DecisionRecord:
    """A decision record of a random request on ``views``, not decided yet (pick None), with
    prefix hits on a few pods."""
    target = rng.choice((*ADAPTERS, "base"))
    blocks = rng.randint(0, 16)
    hits = {view.name: rng.randint(1, blocks) for view in rng.sample(views, min(2, len(views)))
            } if blocks else {}
    return DecisionRecord(
        request_id=f"req-{index}", seq=index, time_ns=time_ns, model=f"model-{target}",
        target_model=target, criticality=rng.choice(CRITICALITIES),
        prompt_tokens=rng.randint(1, 8000), max_tokens=rng.randint(0, 1000),
        prefix_blocks=blocks, prefix_hits=hits, policy=policy, draw=rng.getrandbits(64),
        view=views, pick=None)


class Recorder:
    """One picker's policy for the pool, kept across its decisions as a picker keeps it."""

    def __init__(self, config: PolicyConfig) -> None:
        self.rng = random.Random()
        self.policy: Policy = build_policy(config, self.rng)

    def decide(self, record: DecisionRecord) -> DecisionRecord:
        """``record`` with the policy's pick or shed, decided under the draw contract."""
        self.rng.seed(record.draw)
        request = SchedulingRequest(
            model=record.model, target_model=record.target_model,
            criticality=record.criticality, prompt_tokens=record.prompt_tokens,
            max_tokens=record.max_tokens, prefix_hashes=tuple(range(record.prefix_blocks)),
            prefix_hits=record.prefix_hits)
        decision = self.policy.schedule(request, record.view)
        return msgspec.structs.replace(
            record, pick=decision.pick.name if decision.pick else None, shed=decision.shed)


def write(path: Path, spec: Spec) -> list[DecisionRecord]:
    """Write a recording of ``spec`` to ``path``; return the decision records in file order."""
    rng = random.Random(spec.seed)
    recorded: list[DecisionRecord] = []
    with path.open("wb") as out:
        writer = Writer(out, FileHeader(created_ns=START_NS, from_ns=START_NS,
                                        to_ns=START_NS + (spec.decisions + 1) * SECOND // 100,
                                        prefix="lig", pool=None, source="test"))
        writer.add(Kind.REGISTRY_STATE, Entry(START_NS, pool_key(spec.pool),
                                              _pool(spec.pool, spec.policy)))
        writer.add(Kind.REGISTRY_STATE, Entry(START_NS, endpoints_key(spec.pool), encode(
            EndpointSet(spec.pool, tuple(Endpoint(f"pod-{index}", f"10.0.0.{index}", 8000)
                                         for index in range(spec.pods))))))
        config = spec.policy
        recorders = {picker: Recorder(config) for picker in spec.pickers}
        pending: dict[str, list[Record]] = {picker: [] for picker in spec.pickers}
        for index in range(spec.decisions):
            time_ns = START_NS + index * SECOND // 100
            if index in spec.changes:
                # As a picker: a new policy only when the config changes, not on every write.
                if spec.changes[index] != config:
                    recorders = {picker: Recorder(spec.changes[index]) for picker in spec.pickers}
                config = spec.changes[index]
                writer.add(Kind.REGISTRY_CHANGE, Entry(time_ns, pool_key(spec.pool),
                                                       _pool(spec.pool, config, index)))
            picker = spec.pickers[index % len(spec.pickers)]
            views = random_view(rng, spec.pods)
            record = recorders[picker].decide(
                random_record(rng, index, time_ns, config.name, views))
            recorded.append(record)
            batch = pending[picker]
            batch.append(record)
            if record.pick is not None:
                batch.append(OutcomeRecord(record.request_id, index, record.pick, 200, 12.5,
                                           80.0, 10, 20))
            if len(batch) >= spec.batch:
                _flush(writer, spec.pool, picker, batch, time_ns)
            if spec.snapshots_every and index % spec.snapshots_every == 0:
                _noise(writer, spec.pool, views[0], index, time_ns)
        for picker, batch in pending.items():
            if batch:
                _flush(writer, spec.pool, picker, batch, START_NS + spec.decisions * SECOND // 100)
        writer.close()
    return recorded


def _pool(pool: str, policy: PolicyConfig, revision: int = 0) -> bytes:
    return encode(InferencePool(name=pool, target_port=8000, policy=policy,
                                selector={"revision": str(revision)}))


def _flush(writer: Writer, pool: str, picker: str, batch: list[Record], time_ns: int) -> None:
    message = RecordBatch(picker=picker, pool=pool, sent_at_ns=time_ns, records=list(batch))
    writer.add(Kind.DECISION, Entry(time_ns, f"records.{escape_token(pool)}",
                                    msgspec.msgpack.encode(message)))
    batch.clear()


def _noise(writer: Writer, pool: str, view: PodView, index: int, time_ns: int) -> None:
    """What else a recording holds between records: a snapshot and a decision-stream message."""
    writer.add(Kind.SNAPSHOT, Entry(time_ns, f"metrics.{pool}.{view.name}", encode(PodMetrics(
        pool=pool, pod=view.name, address=view.address, seq=index, scrape_time_ns=time_ns,
        scrape_duration_s=0.001, ok=True, waiting=view.waiting))))
    writer.add(Kind.DECISION, Entry(time_ns, f"decisions.{escape_token(pool)}",
                                    b"\x93\xa1x\x01\x02"))
