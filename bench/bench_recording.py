"""``lig record``'s export speed and file size on a real nats-server with JetStream.

Fills the collector's recording streams with ``--snapshots`` realistic ``PodMetrics`` (100 pods,
one pool, adapters) and ``--decisions`` opaque decision messages, then per round:

- ``raw read`` (baseline): the same JetStream window read through :func:`recording.streams.
  read_stream` (the same pull consumer, batches and time filter) and dropped;
- ``export``: :func:`recording.export.export` of the same window to a file (reading, merging in
  time order, framing, compressing).

Prints medians over ``--rounds``: messages per second for both and their ratio, and the file's
bytes per snapshot and per decision message against their bytes on the wire. The issue-14
target is ≥ 50,000 recorded messages per second for the export.

Then the flight recorder's size (no NATS needed): ``--records`` decisions at ``--record-rate``
per second, each made by the default policy (``PolicyConfig()``, under the draw contract: the
policy's rng seeded with the record's draw) on a view of 8 pods (``--record-pods``) whose load
moves between decisions, with an outcome (usage tokens) for each routed request when it ends;
records batched as a picker batches them (every 2 ms, ``services/picker/batch_sender.py``'s
default) into ``RecordBatch`` messages on ``records.<pool>``. Reported: bytes per decision
record on the wire (its own encoding, and every batch byte over the decisions: its outcome and
the batch framing included) and in the file: the recording writer
(``recording.fileformat.Writer``, what ``lig record`` writes with) is given the same
time-ordered stream of snapshots (the same pods scraped every 50 ms) with and without the
record batches; the difference over the decisions is what a decision adds to a file, and the
snapshot-only file over its snapshots is a snapshot's share.

Run: ``.venv/bin/python bench/bench_recording.py [--snapshots 100000] [--rounds 3]
[--records 20000] [--record-rate 1000] [--record-pods 8] [--records-only]``
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import io
import logging
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import BinaryIO

import msgspec
import nats

from recording.export import export
from recording.fileformat import Entry, FileHeader, Kind, Writer
from recording.streams import read_stream
from recording.window import Window
from scheduling import PodView, Policy, SchedulingRequest, build_policy
from scheduling.prefix_hash import BLOCK_BYTES, MAX_BLOCKS
from scheduling.record import DecisionRecord, OutcomeRecord, Record, RecordBatch
from services.collector.recording import ensure_recording
from shared.nats_connection import NatsSettings
from shared.schemas import Criticality, PodMetrics, PolicyConfig, encode
from shared.subjects import Subjects
from tests.support.nats_server import NatsServer

SUBJECTS = Subjects()
PODS = 100
DECISION_BYTES = 120  # about a batched routed event


def snapshot(pod: int, seq: int) -> bytes:
    """A snapshot as a busy vLLM pod's scrape gives it."""
    return encode(PodMetrics(
        pool="chat", pod=f"vllm-{pod}", address=f"10.0.{pod // 250}.{pod % 250}:8000", seq=seq,
        scrape_time_ns=time.time_ns(), scrape_duration_s=0.0021, ok=True, waiting=seq % 7,
        running=12 + seq % 5, kv_cache_usage=(seq % 100) / 100,
        running_adapters=("sql-lora", "tweet-summary-1"), waiting_adapters=("tweet-summary-2",),
        max_lora=4, block_size=16, num_gpu_blocks=27_000))


async def fill(url: str, snapshots: int, decisions: int) -> tuple[Window, int, int]:
    """Publish into the recording; the window covering it and the wire bytes of each kind."""
    nc = await nats.connect(url)
    try:
        await ensure_recording(nc.jetstream(), SUBJECTS, 3600.0)
        start = time.time_ns()
        snapshot_bytes = decision_bytes = 0
        for i in range(max(snapshots, decisions)):
            if i < snapshots:
                data = snapshot(i % PODS, i // PODS)
                snapshot_bytes += len(data)
                await nc.publish(SUBJECTS.metrics("chat", f"vllm-{i % PODS}"), data)
            if i < decisions:
                data = (b"%016d" % i) * (DECISION_BYTES // 16)
                decision_bytes += len(data)
                await nc.publish(SUBJECTS.decisions("chat"), data)
            if i % 2000 == 0:
                await nc.flush()
        await nc.flush()
        js = nc.jetstream()
        for stream, wanted in ((SUBJECTS.metrics_stream, snapshots),
                               (SUBJECTS.decisions_stream, decisions)):
            for _ in range(600):  # the server stores asynchronously: at most a minute
                if (await js.stream_info(stream)).state.messages >= wanted:
                    break
                await asyncio.sleep(0.1)
        return Window(start - 1, time.time_ns()), snapshot_bytes, decision_bytes
    finally:
        await nc.close()


async def raw_read(url: str, window: Window) -> int:
    """Baseline: read both windows, keep nothing; messages read."""
    nc = await nats.connect(url)
    count = 0
    try:
        for stream, subject in ((SUBJECTS.metrics_stream, SUBJECTS.all_metrics()),
                                (SUBJECTS.decisions_stream, SUBJECTS.all_decisions())):
            async for _ in read_stream(nc.jetstream(), stream, subject, window.from_ns,
                                       window.to_ns):
                count += 1
    finally:
        await nc.close()
    return count


RECORD_PODS = 8  # pods in each recorded view (--record-pods)
RECORD_BATCH_NS = 2_000_000  # the pickers' batching window (services/picker/batch_sender.py)
SCRAPE_NS = 50_000_000  # the collector's default scrape interval
BASE_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
ADAPTERS = ("sql-lora", "tweet-summary-1", "tweet-summary-2", "chat-support")
# Criticality shares (Critical, Standard, Sheddable): mixed traffic, most of it Standard.
CRITICALITY_WEIGHTS = ((Criticality.CRITICAL, 0.2), (Criticality.STANDARD, 0.6),
                       (Criticality.SHEDDABLE, 0.2))


class _Pod:
    """One pod's load, moving a little between decisions (a random walk, not a simulator)."""

    def __init__(self, index: int, rng: random.Random) -> None:
        self.index = index
        self.name = f"vllm-chat-{index}"
        self.waiting = rng.randint(0, 4)
        self.running = rng.randint(4, 40)
        self.kv = rng.uniform(0.1, 0.6)
        self.adapters = frozenset(rng.sample(ADAPTERS, 2))
        self.in_flight = 0
        self.unreported = 0
        self.seq = 0

    def step(self, rng: random.Random) -> None:
        self.waiting = max(0, self.waiting + rng.choice((-1, -1, 0, 0, 1, 1, 2)) - (
            1 if self.waiting > 8 else 0))
        self.running = min(256, max(0, self.running + rng.randint(-2, 2)))
        self.kv = min(1.0, max(0.0, self.kv + rng.gauss(0.0, 0.01)))
        if rng.random() < 0.002:
            self.adapters = frozenset(rng.sample(ADAPTERS, rng.randint(1, 3)))

    def view(self) -> PodView:
        return PodView(
            name=self.name, address=f"10.12.{self.index}.7:8000", waiting=self.waiting,
            running=self.running, kv_cache_usage=round(self.kv, 4),
            running_adapters=self.adapters, waiting_adapters=frozenset(), max_lora=4,
            in_flight=self.in_flight, unreported_tokens=self.unreported)

    def snapshot(self, time_ns: int) -> bytes:
        self.seq += 1
        return encode(PodMetrics(
            pool="chat", pod=self.name, address=f"10.12.{self.index}.7:8000", seq=self.seq,
            scrape_time_ns=time_ns, scrape_duration_s=0.0021, ok=True, waiting=self.waiting,
            running=self.running, kv_cache_usage=round(self.kv, 4),
            running_adapters=tuple(sorted(self.adapters)), max_lora=4, block_size=16,
            num_gpu_blocks=27_000))


class RecordedTraffic(msgspec.Struct):
    """A time-ordered stream of what a recording of one pool holds: (time, kind, name, data)."""

    snapshots: list[tuple[int, bytes]]
    batches: list[tuple[int, bytes]]
    decisions: int
    outcomes: int
    sheds: int
    decision_bytes: int  # the decision records' own encodings, summed
    outcome_bytes: int


def recorded_traffic(decisions: int, rate: float, seed: int = 1,
                     pods: int = RECORD_PODS) -> RecordedTraffic:
    """``decisions`` decisions at ``rate``/s by the default policy on ``pods`` moving pods, their
    outcomes when the requests end, batched every 2 ms per picker; and the pods' snapshots."""
    rng = random.Random(seed)
    fleet = [_Pod(index, rng) for index in range(pods)]
    by_name = {pod.name: pod for pod in fleet}
    policy_rng = random.Random()
    policy = build_policy(PolicyConfig(), policy_rng)
    start = 1_790_000_000_000_000_000
    ending: list[tuple[int, int, OutcomeRecord]] = []  # (end time, seq, outcome) heap
    pending: list[tuple[int, Record]] = []
    snapshots: list[tuple[int, bytes]] = []
    next_scrape = start
    time_ns = start
    decision_bytes = outcome_bytes = outcomes = sheds = 0
    for seq in range(decisions):
        time_ns += round(rng.expovariate(rate) * 1e9)
        while next_scrape <= time_ns:
            snapshots.extend((next_scrape, pod.snapshot(next_scrape)) for pod in fleet)
            for pod in fleet:
                pod.unreported = 0
            next_scrape += SCRAPE_NS
        while ending and ending[0][0] <= time_ns:
            end_ns, _, outcome = heapq.heappop(ending)
            by_name[outcome.served].in_flight -= 1
            pending.append((end_ns, outcome))
            outcome_bytes += len(encode(outcome))
            outcomes += 1
        for pod in fleet:
            pod.step(rng)
        record = _decide(rng, policy, policy_rng, seq, time_ns, [pod.view() for pod in fleet])
        decision_bytes += len(encode(record))
        sheds += record.shed
        pending.append((time_ns, record))
        if record.pick is not None:
            pod = by_name[record.pick]
            pod.in_flight += 1
            pod.unreported += record.prompt_tokens
            completion = record.max_tokens or round(rng.lognormvariate(math.log(129), 0.99))
            duration_ms = 40 + completion * 7.0 + rng.uniform(0, 60)
            outcome = OutcomeRecord(
                request_id=record.request_id, seq=seq, served=record.pick, status=200,
                ttfb_ms=round(35 + rng.uniform(0, 60), 3), duration_ms=round(duration_ms, 3),
                prompt_tokens=record.prompt_tokens + rng.randint(-20, 20),
                completion_tokens=max(1, completion - rng.randint(0, completion // 3)))
            heapq.heappush(ending, (time_ns + round(duration_ms * 1e6), seq, outcome))
    while ending:
        end_ns, _, outcome = heapq.heappop(ending)
        pending.append((end_ns, outcome))
        outcome_bytes += len(encode(outcome))
        outcomes += 1
    return RecordedTraffic(snapshots=snapshots, batches=_batches(pending), decisions=decisions,
                           outcomes=outcomes, sheds=sheds, decision_bytes=decision_bytes,
                           outcome_bytes=outcome_bytes)


def _decide(rng: random.Random, policy: Policy, policy_rng: random.Random, seq: int,
            time_ns: int, views: list[PodView]) -> DecisionRecord:
    """One request as a picker records it, decided by ``policy`` on ``views``."""
    prompt = max(1, min(16_000, round(rng.lognormvariate(math.log(1020), 0.5))))
    blocks = min(MAX_BLOCKS, prompt * 4 // BLOCK_BYTES)  # ~4 bytes of prompt text per token
    hits = {view.name: rng.randint(1, blocks) for view in rng.sample(views, rng.randint(0, 2))
            } if blocks else {}
    target = BASE_MODEL if rng.random() < 0.7 else rng.choice(ADAPTERS)
    criticality = rng.choices([c for c, _ in CRITICALITY_WEIGHTS],
                              [w for _, w in CRITICALITY_WEIGHTS])[0]
    max_tokens = rng.choice((0, 256, 512, 1024))
    draw = rng.getrandbits(64)
    policy_rng.seed(draw)
    decision = policy.schedule(
        SchedulingRequest(model=target, target_model=target, criticality=criticality,
                          prompt_tokens=prompt, max_tokens=max_tokens,
                          prefix_hashes=tuple(range(blocks)), prefix_hits=hits), views)
    pick = decision.pick.name if decision.pick else None
    fallbacks = tuple(view.name for view in decision.candidates if view.name != pick)[:2]
    return DecisionRecord(
        request_id=f"{rng.getrandbits(128):032x}", seq=seq, time_ns=time_ns, model=target,
        target_model=target, criticality=criticality, prompt_tokens=prompt,
        max_tokens=max_tokens, prefix_blocks=blocks, prefix_hits=hits, policy="prefix-aware",
        draw=draw, view=tuple(views), pick=pick, shed=decision.shed, fallbacks=fallbacks)


def _batches(pending: list[tuple[int, Record]]) -> list[tuple[int, bytes]]:
    """The records in 2 ms windows, one ``RecordBatch`` per window, sent at its end."""
    pending.sort(key=lambda item: item[0])
    batches: list[tuple[int, bytes]] = []
    window: list[Record] = []
    window_end = 0
    for time_ns, record in pending:
        if window and time_ns >= window_end:
            batches.append((window_end, encode(RecordBatch("picker-7f9c", "chat", window_end,
                                                           window))))
            window = []
        if not window:
            window_end = time_ns + RECORD_BATCH_NS
        window.append(record)
    if window:
        batches.append((window_end, encode(RecordBatch("picker-7f9c", "chat", window_end,
                                                       window))))
    return batches


def write_recording(out: BinaryIO, snapshots: list[tuple[int, bytes]],
                    batches: list[tuple[int, bytes]]) -> None:
    """The recording ``lig record`` would write of these messages: one time order, record
    batches as DECISION frames named ``records.chat``."""
    frames = sorted([(time_ns, Kind.SNAPSHOT, data) for time_ns, data in snapshots]
                    + [(time_ns, Kind.DECISION, data) for time_ns, data in batches],
                    key=lambda frame: frame[0])
    writer = Writer(out, FileHeader(created_ns=0, from_ns=0, to_ns=0, prefix="lig"))
    for time_ns, kind, data in frames:
        name = "records.chat" if kind == Kind.DECISION else "metrics.chat.vllm-chat-0"
        writer.add(kind, Entry(time_ns, name, data))
    writer.close()


def file_bytes(snapshots: list[tuple[int, bytes]], batches: list[tuple[int, bytes]]) -> int:
    """The size of :func:`write_recording`'s file of these messages."""
    out = io.BytesIO()
    write_recording(out, snapshots, batches)
    return len(out.getvalue())


def report_record_sizes(decisions: int, rate: float, pods: int = RECORD_PODS) -> None:
    """Print the flight recorder's bytes per decision on the wire and in the file."""
    traffic = recorded_traffic(decisions, rate, pods=pods)
    wire = sum(len(data) for _, data in traffic.batches)
    with_records = file_bytes(traffic.snapshots, traffic.batches)
    snapshots_only = file_bytes(traffic.snapshots, [])
    records_only = file_bytes([], traffic.batches)
    snapshot_wire = sum(len(data) for _, data in traffic.snapshots)
    count = traffic.decisions
    print(f"flight records: {count:,} decisions at {rate:g}/s by the default policy on "
          f"{pods}-pod views ({traffic.sheds:,} shed), {traffic.outcomes:,} outcomes, "
          f"{len(traffic.batches):,} "
          f"batches ({(count + traffic.outcomes) / len(traffic.batches):.1f} records each)")
    print(f"  on the wire: {traffic.decision_bytes / count:,.0f} B per decision record, "
          f"{traffic.outcome_bytes / max(traffic.outcomes, 1):,.0f} B per outcome record; "
          f"{wire / count:,.0f} B of RecordBatch per decision (outcome and batch included)")
    print(f"  in the file: {(with_records - snapshots_only) / count:,.1f} B per decision "
          f"(with its outcome) beside {len(traffic.snapshots):,} snapshots of the same "
          f"{pods} pods; {records_only / count:,.1f} B in a file of records alone "
          f"({wire / records_only:.1f}x smaller than the wire)")
    print(f"  snapshots: {snapshot_wire / len(traffic.snapshots):,.0f} B on the wire, "
          f"{snapshots_only / len(traffic.snapshots):,.1f} B in the file; per hour at "
          f"{rate:g} decisions/s: {(with_records - snapshots_only) / count * rate * 3600 / 1e9:.2f}"
          f" GB of records in a file, {wire / count * rate * 3600 / 1e9:.2f} GB on the wire "
          "(the stream's size)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--snapshots", type=int, default=100_000)
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--records", type=int, default=20_000,
                        help="decision records for the size report (0: skip it)")
    parser.add_argument("--record-rate", type=float, default=1000.0,
                        help="decisions per second of the recorded traffic")
    parser.add_argument("--record-pods", type=int, default=RECORD_PODS,
                        help="pods in each recorded view (a decision records every candidate)")
    parser.add_argument("--records-only", action="store_true",
                        help="only the flight records' size report (no NATS)")
    args = parser.parse_args()
    if args.records_only:
        report_record_sizes(args.records, args.record_rate, args.record_pods)
        return 0
    logging.getLogger("lig").setLevel(logging.ERROR)  # "no registry bucket here" is expected
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp) / "js")
        server.start()
        try:
            window, snapshot_bytes, decision_bytes = asyncio.run(
                fill(server.url, args.snapshots, args.decisions))
            total = args.snapshots + args.decisions
            raw, exported, sizes = [], [], []
            for _ in range(args.rounds):
                began = time.perf_counter()
                assert asyncio.run(raw_read(server.url, window)) == total
                raw.append(total / (time.perf_counter() - began))
                out = io.BytesIO()
                began = time.perf_counter()
                counts = asyncio.run(export(NatsSettings(url=server.url), window, out, None))
                exported.append(total / (time.perf_counter() - began))
                assert counts.get("snapshot") == args.snapshots, counts
                sizes.append(len(out.getvalue()))
        finally:
            server.stop()
    raw_median, export_median = statistics.median(raw), statistics.median(exported)
    size = statistics.median(sizes)
    wire = snapshot_bytes + decision_bytes
    print(f"{args.snapshots} snapshots + {args.decisions} decisions, medians of {args.rounds}:")
    print(f"  raw read (baseline)  {raw_median:>10,.0f} msg/s")
    print(f"  export to file       {export_median:>10,.0f} msg/s   "
          f"ratio {export_median / raw_median:.2f}x of the raw read  (target >= 50,000 msg/s)")
    print(f"  file {size:,.0f} B for {wire:,} B on the wire ({wire / size:.1f}x smaller); "
          f"on the wire {snapshot_bytes / args.snapshots:.0f} B/snapshot, "
          f"{decision_bytes / max(args.decisions, 1):.0f} B/decision; in the file "
          f"~{size / total:.1f} B/message overall")
    if args.records:
        report_record_sizes(args.records, args.record_rate, args.record_pods)
    return 0


if __name__ == "__main__":
    sys.exit(main())
