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

Run: ``.venv/bin/python bench/bench_recording.py [--snapshots 100000] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nats

from recording.export import export
from recording.streams import read_stream
from recording.window import Window
from services.collector.recording import ensure_recording
from shared.nats_connection import NatsSettings
from shared.schemas import PodMetrics, encode
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--snapshots", type=int, default=100_000)
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
