"""The stack the tools act on: one they start themselves, or one already running (attach).

A started stack is ``lig up --free-ports``'s plan (:func:`lig.up.make_plan`) run under a
:class:`lig.supervisor.Supervisor` in this process rather than as a ``lig up`` child: ``lig up``
stops the whole stack as soon as one service dies, and the chaos tool must kill single services
and start them again. Each simulated pod gets a process of its own (``sim-0``, ``sim-1``, ...),
so that stopping one (SIGSTOP) stops only that pod.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import signal
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec

from lig import readiness, up
from lig.port_leases import PortLeases
from lig.supervisor import Child, ChildSpec, Supervisor
from lig.topology import LOOPBACK, StackPlan
from resilience.procinfo import pid_listening_on
from resilience.witness import BlockWitness

BASE_MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # Critical in examples/local: never shed
SPLIT_MODEL = "tweet-summary"  # rewritten to tweet-summary-1/-2: the response names it again


class Picker(msgspec.Struct, frozen=True):
    """One picker replica: its ext_proc address and, when known, its pid and metrics URL."""

    name: str
    port: int
    pid: int | None = None
    metrics_url: str | None = None
    host: str = LOOPBACK


class Target(msgspec.Struct, frozen=True):
    """Where to send traffic and attacks."""

    gateway: str
    pickers: tuple[Picker, ...]


def attach(gateway: str, picker_ports: list[int], picker_metrics: list[str]) -> Target:
    """A running stack given by flags; each picker's pid is found from its listening port."""
    pickers = tuple(
        Picker(f"picker-{i}", port, pid_listening_on(port),
               picker_metrics[i] if i < len(picker_metrics) else None)
        for i, port in enumerate(picker_ports))
    return Target(gateway.rstrip("/"), pickers)


class OwnedStack:
    """A stack this process started: its plan, its supervisor, and fault controls."""

    def __init__(self, plan: StackPlan, supervisor: Supervisor) -> None:
        self.plan = plan
        self.supervisor = supervisor
        self.witness: BlockWitness | None = None  # the pods' true block sets, when asked for

    @property
    def target(self) -> Target:
        """The running stack as a :class:`Target` (pickers with pids and metrics URLs)."""
        pids = {child.name: child.pid for child in self.supervisor.children}
        urls = self.plan.picker_metrics_urls()
        pickers = tuple(Picker(f"picker-{i}", ports.grpc, pids.get(f"picker-{i}"), urls[i])
                        for i, ports in enumerate(self.plan.ports.pickers))
        return Target(self.plan.gateway_url(), pickers)

    def child(self, name: str) -> Child:
        """The current process of service ``name``."""
        return next(child for child in self.supervisor.children if child.name == name)

    def kill(self, name: str) -> None:
        """SIGKILL service ``name`` (its whole process group) and reap it."""
        child = self.child(name)
        child.stopping = True  # a death we caused, not one to report
        child.signal_group(signal.SIGKILL)
        child.process.wait(timeout=5)

    def restart(self, name: str) -> None:
        """Start the killed service ``name`` again."""
        self.supervisor.restart(name)

    def pause(self, name: str, paused: bool) -> None:
        """SIGSTOP (``paused``) or SIGCONT service ``name``."""
        self.child(name).signal_group(signal.SIGSTOP if paused else signal.SIGCONT)

    def start(self, spec: ChildSpec) -> Child:
        """Start one more process under the stack's supervisor (stopped with the stack)."""
        return self.supervisor.start(spec)

    def unexpected_exit(self) -> str | None:
        """The report of a service that died although nobody killed it, if one did."""
        dead = self.supervisor.first_exited()
        return None if dead is None else dead.describe_exit(lines=10)

    async def wait_ready(self, within: float) -> str | None:
        """Wait until every service is ready again; None when it is, else what is not."""
        # Its progress lines ("lig up: nats ready ...") are lig up's, not this tool's output.
        with contextlib.redirect_stdout(io.StringIO()):
            return await readiness.wait_until_ready(self.plan, self.supervisor,
                                                    asyncio.Event(), within)


def _plan_args(state_dir: Path, gateway: int, pods: int, pickers: int, sim_args: str,
               response_timeout: float) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.configure(parser)
    return parser.parse_args([
        "--free-ports", "--port", str(gateway), "--state-dir", str(state_dir),
        "--pods", str(pods), "--pickers", str(pickers), "--sim-args", sim_args,
        "--response-timeout", str(response_timeout), "--log-level", "WARNING",
        # The failures are measured on pickers as production runs them: responses bypass them.
        "--no-record-responses",
    ])


def _one_sim_per_pod(specs: list[ChildSpec], plan: StackPlan,
                     replay_buffer: int | None = None) -> list[ChildSpec]:
    """``lig up``'s children with its one ``sim`` process split into one process per pod (each
    publishing its KV-cache events on its own pod's ports, keeping ``replay_buffer`` batches for
    replays when given: vLLM's ``buffer_steps``)."""
    split: list[ChildSpec] = []
    for spec in specs:
        if spec.name != "sim":
            split.append(spec)
            continue
        for index, pod in enumerate(plan.pods):
            argv = list(spec.argv)
            argv[argv.index("--pods") + 1] = "1"
            argv[argv.index("--base-port") + 1] = str(pod.port)
            events = plan.sim_kv_events_flags(pod.port)
            if events:
                config = msgspec.json.decode(events[1])
                if replay_buffer is not None:
                    config["buffer_steps"] = replay_buffer
                argv[argv.index(events[0]) + 1] = msgspec.json.encode(config).decode()
            split.append(ChildSpec(f"sim-{index}", argv, spec.env))
    return split


def _with_picker_args(specs: list[ChildSpec], picker_args: list[str]) -> list[ChildSpec]:
    """``specs`` with ``picker_args`` added to every picker's flags (last: they override)."""
    return [ChildSpec(spec.name, [*spec.argv, *picker_args], spec.env)
            if spec.name.startswith("picker-") else spec for spec in specs]


def _witness(plan: StackPlan) -> BlockWitness:
    """A witness of every simulated pod's KV-event PUB socket."""
    return BlockWitness({pod.name: f"tcp://{LOOPBACK}:{plan.ports.kv_event_ports(pod.port)[0]}"
                         for pod in plan.pods})


@contextlib.asynccontextmanager
async def own_stack(pods: int = 4, pickers: int = 2, sim_args: str = "",
                    ready_timeout: float = 60.0, state_dir: Path | None = None,
                    response_timeout: float = 120.0, witness: bool = False,
                    replay_buffer: int | None = None,
                    picker_args: tuple[str, ...] = ()) -> AsyncIterator[OwnedStack]:
    """Start a stack on free loopback ports, wait until it serves, stop it all on exit.

    ``response_timeout`` is ``lig up --response-timeout``: how long Envoy waits for a silent pod.
    With ``witness`` a :class:`BlockWitness` (``stack.witness``) subscribes to every pod's KV
    events as the pods start, and the stack is handed over only once it is connected to all of
    them: no batch a request causes can be published before the witness hears it.
    ``replay_buffer`` is each pod's KV-event replay buffer in batches (the simulator's default,
    vLLM's 10,000, when None). ``picker_args`` are more ``lig picker`` flags for every picker
    (the soak's index bounds).
    """
    with contextlib.ExitStack() as cleanup:
        if state_dir is None:
            state_dir = Path(cleanup.enter_context(tempfile.TemporaryDirectory(
                prefix="lig-resilience-")))
        leases = cleanup.enter_context(PortLeases())  # held until every child is gone
        plan, _ = up.make_plan(_plan_args(state_dir, leases.take(), pods, pickers, sim_args,
                                          response_timeout), leases)
        supervisor = Supervisor(state_dir / "logs")
        stack = OwnedStack(plan, supervisor)
        try:
            specs = _one_sim_per_pod(plan.children(), plan, replay_buffer)
            for spec in _with_picker_args(specs, list(picker_args)):
                supervisor.start(spec)
            if witness:
                stack.witness = _witness(plan)
                stack.witness.start()
            failure = await stack.wait_ready(ready_timeout)
            if failure is not None:
                raise RuntimeError(f"the stack did not become ready: {failure}")
            if stack.witness is not None:
                unheard = await stack.witness.wait_connected(ready_timeout)
                if unheard:
                    raise RuntimeError("the block witness could not connect to the KV events "
                                       f"of {', '.join(unheard)}")
            yield stack
        finally:
            if stack.witness is not None:
                stack.witness.stop()
            supervisor.stop_all(timeout=up.STOP_TIMEOUT)
