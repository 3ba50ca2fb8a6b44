"""What the gray-pod guard's outcome sampling costs the picker, through a real Envoy.

Two picker processes (the default built-in server) serve the same pool behind two Envoys: one
with the default ``--outcome-sample 4`` (Envoy sends the response headers of one request in
four on the routing stream, a third message), one with ``--outcome-sample 0`` (two messages per
request, as before the guard). The same closed-loop load runs against each in alternation; the
result is the median picker CPU per request of each and their ratio, plus throughput and p50.

Run: ``.venv/bin/python bench/bench_outcome_sampling.py [--duration 4] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_picker import POOL, closed_loop, cpu_seconds, request_bytes
from envoy_bootstrap import envoy_config
from tests.support.envoy import EnvoyProcess
from tests.support.fleet_feed import FleetFeed
from tests.support.nats_server import NatsServer
from tests.support.picker import PickerProcess
from tests.support.ports import free_port, wait_for_port
from tests.support.processes import die_with_parent

VARIANTS = {"sampling 1 in 4 (default)": "4", "no sampling": "0"}


class Stack:
    """NATS, one upstream, and per variant a picker behind its own Envoy."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.nats = NatsServer(workdir / "jetstream")
        self.port = free_port()
        self.upstream: subprocess.Popen[bytes] | None = None
        self.feed: FleetFeed | None = None
        self.variants: dict[str, tuple[PickerProcess, EnvoyProcess]] = {}

    def start(self) -> Stack:
        self.nats.start()
        self.upstream = subprocess.Popen(
            [sys.executable, "-m", "tests.support.upstream", "--port", str(self.port),
             "--name", "pod-0"], cwd=Path(__file__).resolve().parents[1],
            preexec_fn=die_with_parent)
        wait_for_port(self.port)
        address = f"127.0.0.1:{self.port}"
        self.feed = FleetFeed(self.nats.url, POOL).start()
        self.feed.set_pool(target_port=self.port)
        self.feed.set_model("bench-model")
        self.feed.set_endpoints({"pod-0": address})
        self.feed.set_metrics("pod-0", address, waiting=1, running=4, kv_cache_usage=0.3)
        for name, sample in VARIANTS.items():
            picker = PickerProcess(POOL, self.nats.url, self.workdir, log_level="WARNING",
                                   extra_args=("--outcome-sample", sample)).start()
            picker.wait_ready()
            envoy = EnvoyProcess(envoy_config(
                listener_port=free_port(), admin_port=free_port(), pickers=[picker.endpoint],
                listener_host="127.0.0.1"), self.workdir).start()
            self.variants[name] = (picker, envoy)
        return self

    def stop(self) -> None:
        for picker, envoy in self.variants.values():
            envoy.stop()
            picker.stop()
        if self.feed is not None:
            self.feed.stop()
        if self.upstream is not None:
            self.upstream.terminate()
            self.upstream.wait(5)
        self.nats.stop()


async def measure(stack: Stack, args: argparse.Namespace) -> dict[str, list[tuple[float, ...]]]:
    """Per variant and round: (req/s, p50 ms, picker CPU us per request)."""
    payload = request_bytes("bench-model")
    for _, envoy in stack.variants.values():  # warm up
        await closed_loop(envoy.listen_port, payload, 4, 1.0, 500)
    samples: dict[str, list[tuple[float, ...]]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, (picker, envoy) in stack.variants.items():
            before = cpu_seconds(picker.pid)
            result = await closed_loop(envoy.listen_port, payload, args.connections,
                                       args.duration, max_requests=args.max_requests)
            served = result.ok + result.failed
            samples[name].append((result.rate, result.percentile(0.5) * 1e3,
                                  (cpu_seconds(picker.pid) - before) / served * 1e6))
    return samples


def run(args: argparse.Namespace) -> int:
    """Start the stack, measure each variant ``--rounds`` times, print medians and the ratio."""
    with tempfile.TemporaryDirectory() as workdir:
        stack = Stack(Path(workdir))
        try:
            samples = asyncio.run(measure(stack.start(), args))
        finally:
            stack.stop()
    print(f"bench_outcome_sampling: medians of {args.rounds} rounds, {args.duration:g} s each, "
          f"closed loop, {args.connections} connections")
    print(f"{'picker':28} {'req/s':>8} {'p50 ms':>8} {'picker CPU us/req':>18}")
    medians = {name: [statistics.median(column) for column in zip(*rows, strict=True)]
               for name, rows in samples.items()}
    for name, (rate, p50, cpu) in medians.items():
        print(f"{name:28} {rate:8.0f} {p50:8.2f} {cpu:18.0f}")
    sampled, plain = (medians[name][2] for name in VARIANTS)
    print(f"CPU per request, sampling / no sampling: {sampled / plain:.2f}")
    return 0


def main() -> int:
    """Parse the flags and run."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=16, help="closed-loop clients")
    parser.add_argument("--max-requests", type=int, default=50_000,
                        help="cap per closed-loop run")
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
