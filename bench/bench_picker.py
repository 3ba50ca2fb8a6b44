"""The picker on the hot path: throughput, latency and CPU per request through a real Envoy.

One Envoy (one worker thread) serves two listeners in the same run: the shipped gateway
(ext_proc -> one picker process with the default built-in HTTP/2 server -> ORIGINAL_DST) and a
baseline listener routing to the same upstreams on a static route. A bounded load generator
(count and time) measures each in turn:

- closed loop (fixed connections, as fast as possible): requests/s, p50/p99;
- open loop at a fixed rate (default 300 requests/s): p50/p99 and the added p50;
- the picker process's CPU time per request, from /proc/<pid>/stat;
- the same for a second picker running ``--server grpc-aio`` behind its own Envoy, and for a
  "floor" ext_proc server (grpc.aio with the picker's server options, answering constant
  messages): what grpc.aio alone costs per request on this machine, logic-free.

Targets (from the picker issue): picker CPU <= 400 us per request; added p50 <= 1.5 ms at
300 requests/s; >= 1,000 requests/s through one Envoy and one picker process.

With ``--compare-body-modes`` it measures instead the routing filter's body modes (BUFFERED,
the shipped one; STREAMED; FULL_DUPLEX_STREAMED, as Gateway API gateways run an endpoint picker),
each through its own Envoy in front of the same picker process, closed and open loop, plain and
rewritten requests, and prints each mode's ratio to BUFFERED measured in the same run.

A run with a ``--chat-tokens`` (4,000) chat prompt measures the prompt-aware request path (the
picker reads, estimates and hashes every prompt, matches and records it in the pool's prefix
index); ``--policy prefix-aware`` runs the pool on the scorer pipeline that uses them (issue 11
target: <= 150 us CPU per request with everything on, >= 0.25x the static route's throughput).
``--seed-rev REV`` (default: main before the picker read prompts) adds a third picker running
that revision's code (from git) behind its own Envoy: the same requests on the seed's request
path, in the same run, so the ratio shows what reading prompts costs.

With ``--compare-recording`` it measures instead what the flight recorder costs (issue 14
target: <= 1.15x picker CPU per request): three pickers, each behind its own Envoy, serve the
same closed-loop requests in interleaved rounds: the default (decision records on), one with
``--no-record-decisions`` (the baseline) and one with ``--record-responses``; it prints each
one's CPU per request and its ratio to the baseline's, medians over the rounds.

Run: ``.venv/bin/python bench/bench_picker.py [--duration 4] [--rounds 3]
[--compare-body-modes | --compare-recording] [--policy prefix-aware] [--chat-tokens 4000]
[--no-shared-decisions]``; the measured picker publishes and applies the decision stream unless
``--no-shared-decisions``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import msgspec
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envoy_bootstrap import BODY_MODES, PickerEndpoint, envoy_config
from shared.schemas import PolicyConfig
from tests.support.envoy import EnvoyProcess
from tests.support.fleet_feed import FleetFeed
from tests.support.nats_server import NatsServer
from tests.support.picker import PickerProcess
from tests.support.ports import free_port, wait_for_port
from tests.support.processes import die_with_parent

POOL = "bench"
SEED_REV = "b065d8c"  # main just before the picker read prompts (issue 11)
ROOT = Path(__file__).resolve().parents[1]
PODS = 2
PROMPT = "Summarise the benefits of load balancing for LLM inference. " * 4
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- load generator -----------------------------------------------------------------------


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: send a request, wait for its whole response."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._waiter: asyncio.Future[int] | None = None

    # typeshed keeps BaseProtocol's BaseTransport here, but a stream protocol is always given a
    # Transport (uvloop's is not a subclass of asyncio.Transport, so isinstance cannot narrow).
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ConnectionError("connection closed"))

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        head_end = self._buffer.find(b"\r\n\r\n")
        if head_end < 0 or self._waiter is None:
            return
        head = bytes(self._buffer[:head_end]).lower()
        length_at = head.find(b"content-length:")
        if length_at >= 0:
            line_end = head.find(b"\r\n", length_at)
            length = int(head[length_at + 15 : line_end if line_end >= 0 else None])
            end = head_end + 4 + length
            if len(self._buffer) < end:
                return
        else:  # chunked
            end = self._buffer.find(b"\r\n0\r\n\r\n", head_end) + 7
            if end < 7:
                return
        status = int(head[9:12])
        del self._buffer[:end]
        self._waiter.set_result(status)

    async def request(self, payload: bytes) -> int:
        assert self.transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(payload)
        try:
            return await self._waiter
        finally:
            self._waiter = None


async def _connect(port: int) -> _Connection:
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_connection(_Connection, "127.0.0.1", port)
    return protocol


class LoadResult(msgspec.Struct):
    """One load run: completed requests, failures, wall time and latencies (seconds)."""

    ok: int
    failed: int
    seconds: float
    latencies: list[float]

    @property
    def rate(self) -> float:
        return self.ok / self.seconds

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def closed_loop(port: int, payload: bytes, connections: int, duration: float,
                      max_requests: int) -> LoadResult:
    """``connections`` clients each sending back to back, until time or count runs out."""
    latencies: list[float] = []
    failed = 0
    deadline = time.perf_counter() + duration
    clients = [await _connect(port) for _ in range(connections)]

    async def client(connection: _Connection) -> None:
        nonlocal failed
        while time.perf_counter() < deadline and len(latencies) + failed < max_requests:
            start = time.perf_counter()
            status = await connection.request(payload)
            if status == 200:
                latencies.append(time.perf_counter() - start)
            else:
                failed += 1

    start = time.perf_counter()
    # Bounded in time even if a response never comes (count and time bound the loop itself).
    await asyncio.wait_for(asyncio.gather(*(client(c) for c in clients)), duration + 15)
    elapsed = time.perf_counter() - start
    for connection in clients:
        assert connection.transport is not None
        connection.transport.close()
    return LoadResult(len(latencies), failed, elapsed, latencies)


async def open_loop(port: int, payload: bytes, rate: float, duration: float) -> LoadResult:
    """Requests sent on a fixed schedule; latency counted from the scheduled time."""
    latencies: list[float] = []
    failed = 0
    idle: list[_Connection] = [await _connect(port) for _ in range(8)]
    tasks = []

    async def one(scheduled: float) -> None:
        nonlocal failed
        connection = idle.pop() if idle else await _connect(port)
        status = await connection.request(payload)
        if status == 200:
            latencies.append(time.perf_counter() - scheduled)
        else:
            failed += 1
        idle.append(connection)

    count = int(rate * duration)
    start = time.perf_counter()
    for index in range(count):
        scheduled = start + index / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(scheduled)))
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    elapsed = time.perf_counter() - start
    for connection in idle:
        assert connection.transport is not None
        connection.transport.close()
    return LoadResult(len(latencies), failed, elapsed, latencies)


def chat_bytes(model: str, tokens: int) -> bytes:
    """A chat request of about ``tokens`` prompt tokens (4 characters each): a long system
    prompt and a question."""
    system = (PROMPT * (tokens * 4 // len(PROMPT) + 1))[:tokens * 4 - 200]
    body = msgspec.json.encode({"model": model, "max_tokens": 16, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "Which benefit matters most for a small fleet, and why?"}]})
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)) + body


def request_bytes(model: str) -> bytes:
    body = msgspec.json.encode({"model": model, "prompt": PROMPT, "max_tokens": 16})
    return (b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body)) + body


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


# --- the stack ----------------------------------------------------------------------------


class Stack:
    """NATS, upstream processes, one picker, one Envoy with gateway and baseline listeners."""

    def __init__(self, workdir: Path, body_modes: bool = False,
                 policy: str | None = None, seed_rev: str | None = None,
                 picker_args: tuple[str, ...] = (),
                 variants: dict[str, tuple[str, ...]] | None = None) -> None:
        self.workdir = workdir
        self.picker_args = picker_args  # extra flags of the measured picker (not the others)
        self.policy = policy  # the pool's scheduling policy (None: the picker's default)
        self.seed_rev = seed_rev  # also run a picker of this git revision (None: not)
        self.seed_picker: PickerProcess | None = None
        self.seed_envoy: EnvoyProcess | None = None
        self.body_modes = body_modes  # one Envoy per body mode, instead of the usual parts
        self.mode_envoys: dict[str, EnvoyProcess] = {}
        # Pickers started with other flags, each behind its own Envoy (in mode_envoys), instead
        # of the usual parts; name -> flags.
        self.variants = variants or {}
        self.variant_pickers: dict[str, PickerProcess] = {}
        self.nats = NatsServer(workdir / "jetstream")
        self.upstream_ports = [free_port() for _ in range(PODS)]
        self.upstreams: list[subprocess.Popen[bytes]] = []
        self.feed: FleetFeed | None = None
        self.picker: PickerProcess | None = None
        self.envoy: EnvoyProcess | None = None
        self.aio_picker: PickerProcess | None = None
        self.aio_envoy: EnvoyProcess | None = None
        self.baseline_port = free_port()
        self.floor_port = free_port()
        self.floor: subprocess.Popen[bytes] | None = None
        self.floor_envoy: EnvoyProcess | None = None

    def start(self) -> Stack:
        self.nats.start()
        for index, port in enumerate(self.upstream_ports):
            self.upstreams.append(subprocess.Popen(
                [sys.executable, "-m", "tests.support.upstream", "--port", str(port),
                 "--name", f"pod-{index}"], cwd=Path(__file__).resolve().parents[1],
                preexec_fn=die_with_parent))
        for port in self.upstream_ports:
            wait_for_port(port)
        addresses = {f"pod-{i}": f"127.0.0.1:{port}" for i, port in enumerate(self.upstream_ports)}
        self.feed = FleetFeed(self.nats.url, POOL).start()
        self.feed.set_pool(target_port=self.upstream_ports[0],
                           **({"policy": PolicyConfig(self.policy)} if self.policy else {}))
        self.feed.set_model("bench-model")
        self.feed.set_model("bench-alias", target_models=[{"name": "bench-model-v2", "weight": 1}])
        self.feed.set_endpoints(addresses)
        for name, address in addresses.items():
            self.feed.set_metrics(name, address, waiting=1, running=4, kv_cache_usage=0.3)
        self.picker = PickerProcess(POOL, self.nats.url, self.workdir, log_level="WARNING",
                                    extra_args=self.picker_args).start().wait_ready()
        if self.variants:
            for name, flags in self.variants.items():
                picker = PickerProcess(POOL, self.nats.url, self.workdir, log_level="WARNING",
                                       extra_args=flags).start().wait_ready()
                self.variant_pickers[name] = picker
                self.mode_envoys[name] = EnvoyProcess(envoy_config(
                    listener_port=free_port(), admin_port=free_port(),
                    pickers=[picker.endpoint], listener_host="127.0.0.1"), self.workdir).start()
            return self
        if self.body_modes:
            for body_mode in BODY_MODES:
                self.mode_envoys[body_mode] = EnvoyProcess(envoy_config(
                    listener_port=free_port(), admin_port=free_port(),
                    pickers=[self.picker.endpoint], listener_host="127.0.0.1",
                    body_mode=body_mode), self.workdir).start()
            return self
        config = envoy_config(listener_port=free_port(), admin_port=free_port(),
                              pickers=[self.picker.endpoint], listener_host="127.0.0.1")
        add_baseline_listener(config, self.baseline_port, self.upstream_ports)
        self.envoy = EnvoyProcess(config, self.workdir).start()
        self.aio_picker = PickerProcess(POOL, self.nats.url, self.workdir, log_level="WARNING",
                                        extra_args=("--server", "grpc-aio")).start().wait_ready()
        self.aio_envoy = EnvoyProcess(envoy_config(
            listener_port=free_port(), admin_port=free_port(), pickers=[self.aio_picker.endpoint],
            listener_host="127.0.0.1"), self.workdir).start()
        if self.seed_rev:
            self.seed_picker = PickerProcess(
                POOL, self.nats.url, self.workdir, log_level="WARNING",
                env=seed_environment(self.seed_rev, self.workdir / "seed")).start().wait_ready()
            self.seed_envoy = EnvoyProcess(envoy_config(
                listener_port=free_port(), admin_port=free_port(),
                pickers=[self.seed_picker.endpoint], listener_host="127.0.0.1"),
                self.workdir).start()
        self.floor = subprocess.Popen(
            [sys.executable, __file__, "--serve-constant-answers", str(self.floor_port),
             addresses["pod-0"]], preexec_fn=die_with_parent)
        wait_for_port(self.floor_port)
        floor_endpoint = PickerEndpoint("127.0.0.1", self.floor_port, self.floor_port)
        self.floor_envoy = EnvoyProcess(envoy_config(
            listener_port=free_port(), admin_port=free_port(), pickers=[floor_endpoint],
            listener_host="127.0.0.1"), self.workdir).start()
        return self

    def stop(self) -> None:
        for part in (self.envoy, self.aio_envoy, self.floor_envoy, *self.mode_envoys.values(),
                     self.seed_envoy, self.picker, self.aio_picker, self.seed_picker,
                     *self.variant_pickers.values()):
            if part is not None:
                part.stop()
        if self.floor is not None:
            self.floor.terminate()
            self.floor.wait(5)
        if self.feed is not None:
            self.feed.stop()
        for process in self.upstreams:
            process.terminate()
            process.wait(5)
        self.nats.stop()


def seed_environment(rev: str, folder: Path) -> dict[str, str]:
    """The environment that runs ``lig`` as it was at ``rev``: that tree, from git, first on the
    import path (PYTHONSAFEPATH keeps the current directory's code off it)."""
    folder.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True,
                             check=True, timeout=120).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True, timeout=120)
    return {"PYTHONPATH": str(folder), "PYTHONSAFEPATH": "1"}


def add_baseline_listener(config: dict[str, Any], port: int, upstream_ports: list[int]) -> None:
    """A second listener without ext_proc: a static round-robin route to the same upstreams."""
    resources = config["static_resources"]
    gateway = resources["listeners"][0]
    manager = gateway["filter_chains"][0]["filters"][0]["typed_config"]
    baseline_manager = {
        **manager, "stat_prefix": "baseline",
        "route_config": {"name": "baseline", "virtual_hosts": [{
            "name": "baseline", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "baseline_upstreams"}}],
        }]},
        "http_filters": [f for f in manager["http_filters"]
                         if f["name"] == "envoy.filters.http.router"],
    }
    resources["listeners"].append({
        "name": "baseline",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                        "typed_config": baseline_manager}]}],
    })
    resources["clusters"].append({
        "name": "baseline_upstreams", "type": "STATIC", "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {"cluster_name": "baseline_upstreams", "endpoints": [{
            "lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                "address": "127.0.0.1", "port_value": port_}}}} for port_ in upstream_ports],
        }]},
    })


# --- the ext_proc floor ---------------------------------------------------------------------


def serve_constant_answers(port: int, destination: str) -> None:
    """A grpc.aio ext_proc server that answers every request with fixed messages (no logic)."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from services.picker.app import GIL_SWITCH_INTERVAL, grpc_server

    sys.setswitchinterval(GIL_SWITCH_INTERVAL)  # as the picker does

    headers_answer = pb.ProcessingResponse()
    headers_answer.request_headers.response.clear_route_cache = True
    body_answer = pb.ProcessingResponse()
    option = body_answer.request_body.response.header_mutation.set_headers.add()
    option.header.key, option.header.raw_value = (
        "x-gateway-destination-endpoint", destination.encode())
    option.append_action = option.OVERWRITE_IF_EXISTS_OR_ADD

    class ConstantAnswers(external_processor_pb2_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator: object,
                          context: grpc.aio.ServicerContext[Any, Any]) -> None:
            while True:
                message = await context.read()
                if message is grpc.aio.EOF:
                    return
                await context.write(headers_answer if message.HasField("request_headers")
                                    else body_answer)

    async def serve() -> None:
        server = grpc_server(reuse_port=False)
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
            ConstantAnswers(), server)
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        await servicer.set("envoy.service.ext_proc.v3.ExternalProcessor",
                           health_pb2.HealthCheckResponse.SERVING)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(serve())


# --- measurements -------------------------------------------------------------------------


class Sample(msgspec.Struct):
    rate: float
    p50_ms: float
    p99_ms: float
    picker_cpu_us: float
    failed: int


async def measure(stack: Stack, target: str, mode: str, payload: bytes,
                  args: argparse.Namespace) -> Sample:
    assert stack.picker is not None
    if target in stack.variant_pickers:
        port, pid = stack.mode_envoys[target].listen_port, stack.variant_pickers[target].pid
    elif target in stack.mode_envoys:
        port, pid = stack.mode_envoys[target].listen_port, stack.picker.pid
    else:
        assert stack.envoy is not None
        assert stack.aio_envoy is not None and stack.aio_picker is not None
        assert stack.floor_envoy is not None and stack.floor is not None
        port, pid = {"picker": (stack.envoy.listen_port, stack.picker.pid),
                     "baseline": (stack.baseline_port, 0),
                     "picker-aio": (stack.aio_envoy.listen_port, stack.aio_picker.pid),
                     "floor": (stack.floor_envoy.listen_port, stack.floor.pid),
                     **({"picker-seed": (stack.seed_envoy.listen_port, stack.seed_picker.pid)}
                        if stack.seed_envoy is not None and stack.seed_picker is not None
                        else {})}[target]
    cpu_before = cpu_seconds(pid) if pid else 0.0
    if mode == "closed":
        result = await closed_loop(port, payload, args.connections, args.duration,
                                   max_requests=args.max_requests)
    else:
        result = await open_loop(port, payload, args.rate, args.duration)
    cpu = cpu_seconds(pid) - cpu_before if pid else 0.0
    served = result.ok + result.failed
    return Sample(result.rate, result.percentile(0.5) * 1e3, result.percentile(0.99) * 1e3,
                  cpu / served * 1e6 if target != "baseline" and served else 0.0, result.failed)


def median(samples: list[Sample], field: str) -> float:
    return statistics.median(getattr(sample, field) for sample in samples)


async def run_body_modes(args: argparse.Namespace) -> int:
    """Each body mode through its own Envoy in front of one picker, rounds interleaved."""
    with tempfile.TemporaryDirectory() as workdir:
        stack = Stack(Path(workdir), body_modes=True).start()
        try:
            plain, alias = request_bytes("bench-model"), request_bytes("bench-alias")
            for envoy in stack.mode_envoys.values():
                await closed_loop(envoy.listen_port, plain, 4, 1.0, 500)
            results: dict[str, list[Sample]] = {}
            for _ in range(args.rounds):
                for body_mode in BODY_MODES:
                    for label, mode, payload in (("closed", "closed", plain),
                                                 ("closed, rewritten", "closed", alias),
                                                 ("open", "open", plain)):
                        results.setdefault(f"{body_mode} {label}", []).append(
                            await measure(stack, body_mode, mode, payload, args))
        finally:
            stack.stop()
    print(f"bench_picker --compare-body-modes: medians of {args.rounds} rounds, "
          f"{args.duration:.0f} s each; closed loop {args.connections} connections, open loop "
          f"{args.rate:.0f} req/s")
    print(f"{'run':40} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'picker CPU us/req':>18} "
          f"{'failed':>7}")
    for name, samples in results.items():
        print(f"{name:40} {median(samples, 'rate'):8.0f} {median(samples, 'p50_ms'):8.2f} "
              f"{median(samples, 'p99_ms'):8.2f} {median(samples, 'picker_cpu_us'):18.0f} "
              f"{sum(s.failed for s in samples):7d}")
    base = BODY_MODES[0]
    for body_mode in BODY_MODES[1:]:
        for label in ("closed", "closed, rewritten"):
            rate = (median(results[f"{body_mode} {label}"], "rate")
                    / median(results[f"{base} {label}"], "rate"))
            cpu = (median(results[f"{body_mode} {label}"], "picker_cpu_us")
                   / median(results[f"{base} {label}"], "picker_cpu_us"))
            print(f"{body_mode} / {base} ({label}): throughput {rate:.2f}x, picker CPU per "
                  f"request {cpu:.2f}x")
        p50 = (median(results[f"{body_mode} open"], "p50_ms")
               / median(results[f"{base} open"], "p50_ms"))
        print(f"{body_mode} / {base} (open loop): p50 {p50:.2f}x")
    return 0


RECORDING_VARIANTS = {
    "records off": ("--no-record-decisions",),
    "records on (default)": (),
    "records on, --record-responses": ("--record-responses",),
}


async def run_recording(args: argparse.Namespace) -> int:
    """The flight recorder's cost: pickers with and without it, rounds interleaved."""
    variants = {name: (*flags, *(("--no-shared-decisions",) if args.no_shared_decisions
                                 else ())) for name, flags in RECORDING_VARIANTS.items()}
    with tempfile.TemporaryDirectory() as workdir:
        stack = Stack(Path(workdir), policy=args.policy, variants=variants).start()
        try:
            plain = request_bytes("bench-model")
            for envoy in stack.mode_envoys.values():
                await closed_loop(envoy.listen_port, plain, 4, 1.0, 500)
            results: dict[str, list[Sample]] = {}
            for _ in range(args.rounds):
                for name in variants:
                    results.setdefault(name, []).append(
                        await measure(stack, name, "closed", plain, args))
        finally:
            stack.stop()
    print(f"bench_picker --compare-recording: medians of {args.rounds} rounds, "
          f"{args.duration:.0f} s each; closed loop {args.connections} connections; policy "
          f"{args.policy or 'default'}; decision stream "
          f"{'off' if args.no_shared_decisions else 'on'}")
    print(f"{'picker':34} {'req/s':>8} {'p50 ms':>8} {'picker CPU us/req':>18} {'ratio':>6} "
          f"{'failed':>7}")
    base = median(results["records off"], "picker_cpu_us")
    for name, samples in results.items():
        cpu = median(samples, "picker_cpu_us")
        print(f"{name:34} {median(samples, 'rate'):8.0f} {median(samples, 'p50_ms'):8.2f} "
              f"{cpu:18.1f} {cpu / base:5.2f}x {sum(s.failed for s in samples):7d}")
    ratio = median(results["records on (default)"], "picker_cpu_us") / base
    print(f"  {'PASS' if ratio <= 1.15 else 'MISS'} recording on / off: picker CPU per request "
          f"{ratio:.2f}x <= 1.15x")
    return 0


async def run(args: argparse.Namespace) -> int:
    if args.compare_body_modes:
        return await run_body_modes(args)
    if args.compare_recording:
        return await run_recording(args)
    with tempfile.TemporaryDirectory() as workdir:
        picker_args = ("--no-shared-decisions",) if args.no_shared_decisions else ()
        stack = Stack(Path(workdir), policy=args.policy, seed_rev=args.seed_rev or None,
                      picker_args=picker_args).start()
        try:
            plain, alias = request_bytes("bench-model"), request_bytes("bench-alias")
            chat = chat_bytes("bench-model", args.chat_tokens)
            # Warm up every path (connections, caches) before measuring.
            assert stack.envoy and stack.aio_envoy and stack.floor_envoy
            ports = [stack.envoy.listen_port, stack.aio_envoy.listen_port,
                     stack.floor_envoy.listen_port, stack.baseline_port]
            if stack.seed_envoy is not None:
                ports.append(stack.seed_envoy.listen_port)
            for port in ports:
                await closed_loop(port, plain, 4, 1.0, 500)
            seed_runs = (("seed picker closed", "picker-seed", "closed", plain),
                         ("seed picker closed, chat", "picker-seed", "closed", chat),
                         ) if stack.seed_envoy is not None else ()
            results: dict[str, list[Sample]] = {}
            for _ in range(args.rounds):
                for name, target, mode, payload in (
                    ("baseline closed", "baseline", "closed", plain),
                    ("picker closed", "picker", "closed", plain),
                    ("picker closed, model rewritten", "picker", "closed", alias),
                    ("picker grpc-aio closed", "picker-aio", "closed", plain),
                    ("grpc.aio floor closed", "floor", "closed", plain),
                    ("baseline open", "baseline", "open", plain),
                    ("picker open", "picker", "open", plain),
                    ("picker grpc-aio open", "picker-aio", "open", plain),
                    ("grpc.aio floor open", "floor", "open", plain),
                    ("baseline closed, chat", "baseline", "closed", chat),
                    ("picker closed, chat", "picker", "closed", chat),
                    *seed_runs,
                ):
                    results.setdefault(name, []).append(
                        await measure(stack, target, mode, payload, args))
        finally:
            stack.stop()
    return report(results, args)


def report(results: dict[str, list[Sample]], args: argparse.Namespace) -> int:
    print(f"bench_picker: medians of {args.rounds} rounds, {args.duration:.0f} s each; "
          f"closed loop {args.connections} connections, open loop {args.rate:.0f} req/s")
    print(f"{'run':34} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'server CPU us/req':>18} "
          f"{'failed':>7}")
    for name, samples in results.items():
        print(f"{name:34} {median(samples, 'rate'):8.0f} {median(samples, 'p50_ms'):8.2f} "
              f"{median(samples, 'p99_ms'):8.2f} {median(samples, 'picker_cpu_us'):18.0f} "
              f"{sum(s.failed for s in samples):7d}")
    throughput = median(results["picker closed"], "rate")
    ratio = throughput / median(results["baseline closed"], "rate")
    added_p50 = median(results["picker open"], "p50_ms") - median(results["baseline open"],
                                                                  "p50_ms")
    cpu = median(results["picker closed"], "picker_cpu_us")
    aio = median(results["picker grpc-aio closed"], "picker_cpu_us")
    floor = median(results["grpc.aio floor closed"], "picker_cpu_us")
    print(f"throughput ratio picker/baseline: {ratio:.2f}; CPU per request (closed loop): "
          f"built-in server {cpu / aio:.2f}x the grpc-aio server's and {cpu / floor:.2f}x a "
          f"logic-free grpc.aio server's")
    checks = [
        (f"picker CPU per request {cpu:.0f} us <= 400 us", cpu <= 400),
        (f"added p50 at {args.rate:.0f} req/s {added_p50:.2f} ms <= 1.5 ms", added_p50 <= 1.5),
        (f"throughput {throughput:.0f} req/s >= 1000 req/s", throughput >= 1000),
    ]
    chat_cpu = median(results["picker closed, chat"], "picker_cpu_us")
    chat_ratio = (median(results["picker closed, chat"], "rate")
                  / median(results["baseline closed, chat"], "rate"))
    stream = "off" if args.no_shared_decisions else "on"
    print(f"{args.chat_tokens}-token chat prompt, policy {args.policy or 'default'}, decision "
          f"stream {stream}: picker CPU "
          f"{chat_cpu:.0f} us/request ({chat_cpu / cpu:.2f}x the short prompt's), throughput "
          f"{chat_ratio:.2f}x the static route's")
    if "seed picker closed, chat" in results:
        seed_chat = median(results["seed picker closed, chat"], "picker_cpu_us")
        seed_plain = median(results["seed picker closed"], "picker_cpu_us")
        print(f"seed picker ({args.seed_rev}, prompts not read), same run: {seed_chat:.0f} us per "
              f"chat request, {seed_plain:.0f} us per short one; reading the chat prompt costs "
              f"{chat_cpu - seed_chat:+.0f} us ({chat_cpu / seed_chat:.2f}x), the short prompt "
              f"{cpu - seed_plain:+.0f} us ({cpu / seed_plain:.2f}x)")
    checks += [
        (f"chat prompt CPU per request {chat_cpu:.0f} us <= 150 us", chat_cpu <= 150),
        (f"chat prompt throughput {chat_ratio:.2f}x >= 0.25x the static route's",
         chat_ratio >= 0.25),
    ]
    for text, passed in checks:
        print(f"  {'PASS' if passed else 'MISS'} {text}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=16, help="closed-loop clients")
    parser.add_argument("--rate", type=float, default=300.0, help="open-loop requests/s")
    parser.add_argument("--max-requests", type=int, default=50_000,
                        help="cap per closed-loop run")
    parser.add_argument("--compare-body-modes", action="store_true",
                        help="measure the routing filter's body modes against each other "
                        "(BUFFERED, STREAMED, FULL_DUPLEX_STREAMED) instead")
    parser.add_argument("--compare-recording", action="store_true",
                        help="measure the flight recorder's cost instead: pickers with decision "
                        "records off, on (the default) and with --record-responses")
    parser.add_argument("--policy", default=None,
                        help="the pool's scheduling policy (default: the picker's default), "
                        "e.g. prefix-aware")
    parser.add_argument("--seed-rev", default=SEED_REV,
                        help="git revision of the seed picker measured beside this one ('' to "
                        "skip)")
    parser.add_argument("--chat-tokens", type=int, default=4000,
                        help="prompt tokens of the chat run's request (4 characters each)")
    parser.add_argument("--no-shared-decisions", action="store_true",
                        help="run the measured picker without the decision stream (lig picker "
                             "--no-shared-decisions), to compare with the default (on)")
    parser.add_argument("--serve-constant-answers", nargs=2, metavar=("PORT", "DESTINATION"),
                        help=argparse.SUPPRESS)  # the floor server's own process
    args = parser.parse_args()
    if args.serve_constant_answers:
        port, destination = args.serve_constant_answers
        serve_constant_answers(int(port), destination)
        return 0
    return uvloop.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
