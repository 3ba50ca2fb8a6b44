"""Recovery of the KV block changes after NATS is killed and restarted (issue 26).

A real nats-server, two busy ``lig sim`` pods publishing KV events, ``lig kv-events`` (from this
checkout, or another one with ``--bridge-repo`` to measure the version before a change). NATS is
SIGKILLed, restarted after ``--down`` seconds on the same store, and the script reports:

- how long after the restart the block changes reach a core NATS subscriber (what the bridge
  publishes) and an ordered JetStream consumer over the recording like the pickers' history feed
  (``services/picker/kv_blocks_feed.py``); the baseline is the same subscriber's first snapshot-like
  message, a heartbeat of the bridge (core NATS, published every 0.2 s);
- what the recording holds against what the pods published: batches missing, resync markers.

    .venv/bin/python bench/bench_kv_events_nats_restart.py --down 5
    .venv/bin/python bench/bench_kv_events_nats_restart.py --bridge-repo /work/main
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nats.aio.msg import Msg  # noqa: E402
from nats.js.api import DeliverPolicy  # noqa: E402

from shared.nats_connection import NatsSettings, connect  # noqa: E402
from tests.support.kv_events import (  # noqa: E402
    SUBJECTS,
    EventPods,
    gauge,
    recorded,
    register,
    until,
)
from tests.support.nats_server import NatsServer  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.waiting import eventually  # noqa: E402


class FirstAfter:
    """The time of the first message received after ``since`` is set."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.first: float | None = None

    async def on_message(self, msg: Msg) -> None:
        if self.since is not None and self.first is None:
            self.first = time.monotonic()


def keep_busy(pods: EventPods, stop: threading.Event) -> None:
    """Requests on every pod, one after the other, until ``stop``."""
    index = 0
    while not stop.is_set():
        # A request lost under load is not what is measured.
        with contextlib.suppress(Exception):
            pods.complete(index % len(pods.ports), f"busy prompt {index} " * 20, max_tokens=4)
        index += 1


def start_bridge(repo: Path, server: NatsServer, pods: EventPods,
                 metrics_port: int) -> subprocess.Popen[bytes]:
    """``lig kv-events`` of checkout ``repo`` following ``pods``."""
    return subprocess.Popen(
        [sys.executable, "-m", "lig.cli", "kv-events", "--nats-url", server.url,
         "--events-port", f"{pods.events_base - pods.ports[0]:+d}",
         "--replay-port", f"{pods.replay_base - pods.ports[0]:+d}", "--host", "127.0.0.1",
         "--metrics-port", str(metrics_port), "--heartbeat", "0.2"],
        cwd=repo, env=os.environ | {"PYTHONPATH": str(repo)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)


async def measure(args: argparse.Namespace) -> None:
    pods = EventPods(2, "map")
    with tempfile.TemporaryDirectory() as store, pods:
        server = NatsServer(Path(store) / "js")
        server.start()
        repo: Path = args.bridge_repo
        metrics_port = free_port()
        bridge = await asyncio.to_thread(start_bridge, repo, server, pods, metrics_port)
        stop = threading.Event()
        try:
            nc = await connect(NatsSettings(url=server.url), "bench")
            await register(nc, [("pod-0", pods.ports[0]), ("pod-1", pods.ports[1])])
            await eventually(lambda: gauge(metrics_port, "lig_kv_events_pods_followed") == 2,
                             within=30, what="the bridge following both pods")
            live, ordered, heartbeat = FirstAfter(), FirstAfter(), FirstAfter()
            await nc.subscribe(SUBJECTS.all_kv_blocks(), cb=live.on_message)
            await nc.subscribe(SUBJECTS.all_kv_events_heartbeats(), cb=heartbeat.on_message)
            await nc.jetstream().subscribe(
                SUBJECTS.all_kv_blocks(), stream=SUBJECTS.kv_blocks_stream,
                cb=ordered.on_message, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL,
                idle_heartbeat=args.ordered_heartbeat)
            busy = threading.Thread(target=keep_busy, args=(pods, stop), daemon=True)
            busy.start()
            await asyncio.sleep(args.warmup)  # load before the fault, as in the chaos run
            server.kill()
            await asyncio.sleep(args.down)  # the outage itself is the fault being measured
            server.start()
            restarted = time.monotonic()
            for observer in (live, ordered, heartbeat):
                observer.since = restarted
            await eventually(lambda: None not in (live.first, ordered.first, heartbeat.first),
                             within=60, what="changes after the restart")
            await asyncio.sleep(args.after)  # the stack under load after the fault
            stop.set()
            await asyncio.to_thread(busy.join)
            last = [pods.kv_event_state(i)["seq"] for i in range(2)]

            async def settled() -> bool:
                changes = await recorded(nc)
                return all(max([c.source_seq for c in changes if c.pod == f"pod-{i}"],
                               default=-1) >= last[i] for i in range(2))

            await until(settled, 30, "every batch published recorded or given up")
            changes = await recorded(nc)
            missing = sum(len(set(range(last[i] + 1)) - {c.source_seq for c in changes
                                                         if c.pod == f"pod-{i}"})
                          for i in range(2))
            print(f"bridge from {repo}: NATS down {args.down:g} s")
            for name, observer in (("heartbeat (core NATS, baseline)", heartbeat),
                                   ("block changes, core subscriber", live),
                                   ("block changes, ordered consumer (pickers' history feed)",
                                    ordered)):
                assert observer.first is not None
                print(f"  {name}: first message {observer.first - restarted:.2f} s after the "
                      "restart")
            print(f"  batches the pods published: {sum(last) + 2}, missing from the recording: "
                  f"{missing}, resync markers: {sum(c.resync for c in changes)}")
            print(f"  stream_seq in the recording: "
                  f"{'yes' if any(c.stream_seq >= 0 for c in changes) else 'no'}")
            await nc.close()
        finally:
            stop.set()
            bridge.kill()
            bridge.wait()
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--down", type=float, default=5.0, help="seconds NATS stays down")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load before")
    parser.add_argument("--after", type=float, default=3.0, help="seconds of load after")
    parser.add_argument("--ordered-heartbeat", type=float, default=None,
                        help="idle heartbeat of the ordered consumer, seconds (default: "
                             "nats-py's 5 s, as the pickers' feed); nats-py recreates the "
                             "consumer after two missed heartbeats")
    parser.add_argument("--bridge-repo", type=lambda text: Path(text).resolve(), default=ROOT,
                        help="checkout whose lig kv-events runs (default: this one)")
    asyncio.run(measure(parser.parse_args()))


if __name__ == "__main__":
    main()
