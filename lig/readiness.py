"""Waiting until the stack ``lig up`` started is ready to serve, or saying why it is not.

Ready means, in order of what usually comes first: NATS answers; the simulated pods answer
``/health``; the registry has published every served pool's endpoints; every pod has a metrics
snapshot (an ok one for simulated pods); ``lig kv-events`` (when it runs) has subscribed to every
simulated pod; every picker reports ``readiness`` SERVING over gRPC
health; Envoy's admin ``/ready`` says LIVE; and a ``GET /v1/models`` through Envoy is answered
(by a picker, from the registry).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import httpx
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NotFoundError

from lig.probes import grpc_serving, http_ok
from lig.supervisor import Supervisor
from lig.topology import LOOPBACK, StackPlan
from services.kvevents.observability import FOLLOWED_GAUGE
from shared import waits
from shared.nats_connection import NatsSettings, connect
from shared.schemas import DecodeError, EndpointSet, PodMetrics, decode
from shared.subjects import Subjects, endpoints_key

POLL_INTERVAL = 0.2
PROBE_TIMEOUT = 1.0


class Check:
    """One readiness condition: a name, an async probe, and whose logs explain a failure."""

    def __init__(self, name: str, probe: Callable[[], Awaitable[bool]], blame: str) -> None:
        self.name = name
        self.probe = probe
        self.blame = blame


class _Stack:
    """The probes, sharing one NATS connection and one HTTP client."""

    def __init__(self, plan: StackPlan, client: httpx.AsyncClient) -> None:
        self.plan = plan
        self.client = client
        self.subjects = Subjects(plan.prefix)
        self.nc: Client | None = None
        self.snapshots: dict[str, PodMetrics] = {}

    async def on_snapshot(self, message: Msg) -> None:
        with contextlib.suppress(DecodeError):
            snapshot = decode(message.data, PodMetrics)
            self.snapshots[snapshot.pod] = snapshot

    async def nats(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def pods(self) -> bool:
        results = await asyncio.gather(*(
            http_ok(self.client, f"http://{pod.hostport}/health") for pod in self.plan.pods))
        return all(results)

    async def registry(self) -> bool:
        if self.nc is None:
            return False
        try:
            # A short timeout: on a cluster the bucket answers only once its stream has a leader
            # (just after it is created with replicas, or after a node is lost); until then the
            # request times out and the check is simply not passed yet.
            js = self.nc.jetstream(timeout=PROBE_TIMEOUT)
            kv = await js.key_value(self.subjects.registry_bucket)
            for pool in self.plan.pools or [self.plan.pool]:
                entry = await kv.get(endpoints_key(pool))
                if not decode(entry.value or b"", EndpointSet).endpoints:
                    return False
        except (BucketNotFoundError, KeyNotFoundError, NotFoundError, DecodeError,
                NatsError, TimeoutError):
            return False
        return True

    async def snapshots_arrived(self) -> bool:
        if self.nc is None:
            return False
        names = self.expected_pods()
        if self.plan.pods:  # simulated pods must be scraped successfully
            return all(name in self.snapshots and self.snapshots[name].ok for name in names)
        return all(name in self.snapshots for name in names)

    def expected_pods(self) -> list[str]:
        return [pod.name for pod in self.plan.pods] or sorted(self.snapshots)

    async def kv_events(self) -> bool:
        """Whether ``lig kv-events`` follows every simulated pod, their events connections up
        and replayed (its ``lig_kv_events_pods_followed`` gauge; real pods' events are
        optional, so for them its metrics answering is enough)."""
        url = f"http://{LOOPBACK}:{self.plan.ports.kv_events_metrics}/metrics"
        try:
            response = await self.client.get(url)
        except httpx.HTTPError:
            return False
        if not response.is_success:
            return False
        return _gauge(response.text, FOLLOWED_GAUGE) >= len(self.plan.pods)

    async def envoy(self) -> bool:
        return await http_ok(self.client, f"http://{LOOPBACK}:{self.plan.ports.envoy_admin}/ready")

    async def gateway(self) -> bool:
        return await http_ok(self.client, f"{self.plan.gateway_url()}/v1/models")

    async def prometheus(self) -> bool:
        return await http_ok(self.client, f"{self.plan.prometheus_url()}/-/ready")


def _checks(stack: _Stack) -> list[Check]:
    plan = stack.plan
    checks = [Check("nats", stack.nats, "nats")]
    if plan.pods:
        checks.append(Check("simulated pods", stack.pods, plan.sim_name(plan.sims[0])))
    checks += [Check("registry", stack.registry, "registry"),
               Check("first snapshots", stack.snapshots_arrived, "collector")]
    if plan.kv_events:
        checks.append(Check("kv-events", stack.kv_events, "kv-events"))
    for i, picker in enumerate(plan.ports.pickers):
        checks.append(Check(f"picker-{i}", partial_grpc(f"{LOOPBACK}:{picker.health}"),
                            f"picker-{i}"))
    checks += [Check("envoy", stack.envoy, "envoy"), Check("gateway", stack.gateway, "envoy")]
    if plan.prometheus:
        checks.append(Check("prometheus", stack.prometheus, "prometheus"))
    return checks


def _gauge(page: str, name: str) -> float:
    """The value of the unlabelled sample ``name`` on a Prometheus page (0 if absent)."""
    for line in page.splitlines():
        if line.startswith(name + " "):
            with contextlib.suppress(ValueError):
                return float(line.split()[1])
    return 0.0


def partial_grpc(target: str) -> Callable[[], Awaitable[bool]]:
    """A probe of a picker's ``readiness`` over gRPC health."""
    async def probe() -> bool:
        return await grpc_serving(target, "readiness", rpc_timeout=1.0)
    return probe


async def wait_until_ready(plan: StackPlan, supervisor: Supervisor, stop: asyncio.Event,
                           within: float) -> str | None:
    """Poll every check until all pass; None when ready (or stopped), else what went wrong.

    A child that exits meanwhile ends the wait at once with its report.
    """
    deadline = time.monotonic() + within
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=1.0) as client:
        stack = _Stack(plan, client)
        connecting = asyncio.create_task(
            connect(NatsSettings(url=plan.nats_url, prefix=plan.prefix), "lig-up"))
        pending = _checks(stack)
        try:
            while pending:
                supervisor.pump_logs()
                dead = supervisor.first_exited()
                if dead is not None:
                    supervisor.pump_logs(final=True)
                    return dead.describe_exit()
                if stop.is_set():
                    return None
                if time.monotonic() > deadline:
                    return _timed_out(pending, supervisor, within)
                if stack.nc is None and connecting.done():
                    stack.nc = connecting.result()
                    await stack.nc.subscribe(stack.subjects.all_metrics(),
                                             cb=stack.on_snapshot)
                for check in list(pending):
                    if await check.probe():
                        pending.remove(check)
                        print(f"lig up: {check.name} ready "
                              f"({time.monotonic() - started:.1f}s)", flush=True)
                    else:
                        break  # later checks depend on earlier ones: no need to probe them yet
                if pending:
                    await waits.wait_set(stop, POLL_INTERVAL)
            for name in stack.expected_pods():
                if not stack.snapshots[name].ok:
                    print(f"lig up: warning: pod {name} cannot be scraped: "
                          f"{stack.snapshots[name].error}", flush=True)
            return None
        finally:
            connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                stack.nc = stack.nc or await connecting
            if stack.nc is not None:
                with contextlib.suppress(Exception):
                    await waits.within(stack.nc.close(), 1.0)


def _timed_out(pending: list[Check], supervisor: Supervisor, within: float) -> str:
    first, later = pending[0], pending[1:]
    lines = [f"timed out after {within:g}s waiting for {first.name}"
             + (f" (not checked yet: {', '.join(c.name for c in later)})" if later else "")]
    child = next((c for c in supervisor.children if c.name == first.blame), None)
    if child is not None:
        lines.append(f"last lines of {child.log_path}:")
        lines += [f"    {line}" for line in child.last_lines(10)] or ["    (empty)"]
    return "\n".join(lines)
