"""What runs where in the local stack: ports, files and the command line of every service.

``lig up`` turns a :class:`StackPlan` into child processes; ``deploy/compose.yaml`` and the
Kubernetes manifests run the same commands with the same ports, which ``tests/test_compose.py``
checks against the names and defaults defined here.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec

from lig.port_leases import PortLeases, bindable
from lig.server_binaries import server_binary
from lig.stack_config import SimulatedPool
from lig.supervisor import ChildSpec
from shared import ports
from shared.schemas import Endpoint

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_CONFIG = REPO_ROOT / "examples" / "local"

# The simulated pods serve this base model plus every other target model of the configuration
# as a LoRA adapter (see lig.stack_config.simulated_models).
BASE_MODEL = "meta-llama/Llama-3.1-8B-Instruct"

DEFAULT_GATEWAY_PORT = ports.GATEWAY
DEFAULT_STATE_DIR = ".lig"
STACK_FILE = "stack.json"  # in the state folder: where `lig status` finds a running stack
LOOPBACK = "127.0.0.1"

# The services' own defaults (their --help says the same); pickers after the first are shifted
# by PICKER_PORT_STRIDE so that several fit on one machine.
NATS_PORT = ports.NATS
ENVOY_ADMIN_PORT = ports.ENVOY_ADMIN
SIM_BASE_PORT = ports.SIMULATOR_BASE
PICKER_GRPC_PORT = ports.PICKER_GRPC
PICKER_HEALTH_PORT = ports.PICKER_HEALTH
PICKER_METRICS_PORT = ports.PICKER_METRICS
COLLECTOR_METRICS_PORT = ports.COLLECTOR_METRICS
REGISTRY_METRICS_PORT = ports.REGISTRY_METRICS
KV_EVENTS_METRICS_PORT = ports.KV_EVENTS_METRICS
PROMETHEUS_PORT = ports.PROMETHEUS
# Where a simulated pod's KV-event sockets are, relative to the port it serves on.
KV_EVENTS_OFFSET = ports.SIMULATOR_KV_EVENTS_BASE - ports.SIMULATOR_BASE
KV_REPLAY_OFFSET = ports.SIMULATOR_KV_REPLAY_BASE - ports.SIMULATOR_BASE
PICKER_PORT_STRIDE = 100


class PickerPorts(msgspec.Struct, frozen=True):
    """The three ports of one picker replica."""

    grpc: int
    health: int
    metrics: int


class Ports(msgspec.Struct, frozen=True):
    """Every port the local stack listens on (all on 127.0.0.1).

    A simulated pod serving on port ``p`` publishes its KV-cache events on
    ``p + kv_events_offset`` and answers replays on ``p + kv_replay_offset`` (offsets, as
    ``lig kv-events --events-port +N`` takes them, because one process hosts many pods).
    """

    gateway: int
    envoy_admin: int
    nats: int
    registry_metrics: int
    collector_metrics: int
    sim_base: int
    pickers: tuple[PickerPorts, ...]
    kv_events_metrics: int = KV_EVENTS_METRICS_PORT
    prometheus: int = PROMETHEUS_PORT  # lig up --observe
    kv_events_offset: int = KV_EVENTS_OFFSET
    kv_replay_offset: int = KV_REPLAY_OFFSET

    def sim_ports(self, pods: int) -> list[int]:
        """The consecutive ports of ``pods`` simulated pods."""
        return list(range(self.sim_base, self.sim_base + pods))

    def kv_event_ports(self, pod_port: int) -> tuple[int, int]:
        """The KV-event PUB and replay ports of the simulated pod serving on ``pod_port``."""
        return pod_port + self.kv_events_offset, pod_port + self.kv_replay_offset


def default_ports(pickers: int, gateway: int = DEFAULT_GATEWAY_PORT) -> Ports:
    """The well-known layout: each service on its default port, pickers 100 apart."""
    return Ports(
        gateway=gateway,
        envoy_admin=ENVOY_ADMIN_PORT,
        nats=NATS_PORT,
        registry_metrics=REGISTRY_METRICS_PORT,
        collector_metrics=COLLECTOR_METRICS_PORT,
        sim_base=SIM_BASE_PORT,
        pickers=tuple(
            PickerPorts(PICKER_GRPC_PORT + i * PICKER_PORT_STRIDE,
                        PICKER_HEALTH_PORT + i * PICKER_PORT_STRIDE,
                        PICKER_METRICS_PORT + i * PICKER_PORT_STRIDE)
            for i in range(pickers)
        ),
    )


def free_ports(leases: PortLeases, pickers: int, pods: int,
               gateway: int = DEFAULT_GATEWAY_PORT, other_pods: Sequence[int] = ()) -> Ports:
    """A layout of free ports from ``leases`` (the simulated pods' ports consecutive).

    The ports stay leased (no other leasing process gets them) while ``leases`` lives, so keep
    it until every child has bound its port. The KV-event offsets put the event and replay
    sockets of every simulated pod on leased ports: the ``pods`` allocated here and those
    serving on ``other_pods`` (pools whose configuration lists their ports, never handed out).
    """
    leases.avoid([gateway, *other_pods])
    sim_base = leases.take_consecutive(max(pods, 1))
    simulated = [*range(sim_base, sim_base + pods), *other_pods]
    events = _leased_offset(simulated, leases) if simulated else KV_EVENTS_OFFSET
    replay = _leased_offset(simulated, leases) if simulated else KV_REPLAY_OFFSET
    take = leases.take
    return Ports(
        gateway=gateway, envoy_admin=take(), nats=take(), registry_metrics=take(),
        collector_metrics=take(), sim_base=sim_base,
        pickers=tuple(PickerPorts(take(), take(), take()) for _ in range(pickers)),
        kv_events_metrics=take(), prometheus=take(), kv_events_offset=events,
        kv_replay_offset=replay,
    )


def _leased_offset(ports: list[int], leases: PortLeases) -> int:
    """An offset that moves every one of ``ports`` onto a leased free port."""
    first = min(ports)
    return leases.take_consecutive(max(ports) - first + 1) - first


def ports_in_use(ports: list[int]) -> list[int]:
    """Those of ``ports`` that something on loopback already listens on or holds."""
    return [port for port in ports if not bindable(port)]


class StackPlan(msgspec.Struct, frozen=True):
    """Everything ``lig up`` starts, decided before anything starts.

    ``nats_url`` is the embedded server's unless the user gave one (``embedded_nats`` False).
    ``pools`` are the pools served (``pool`` the first); the pickers get ``picker_pools`` as
    ``--pool`` flags (empty: they serve every pool of the registry, so pools added to the
    configuration while it runs are served too). ``sims`` are the simulated pools, one
    ``lig sim`` process each, and ``pods`` all their pods (empty when real servers serve).
    With ``kv_events`` the simulated pods publish KV-cache events and one ``lig kv-events``
    (given ``kv_events_args`` last) republishes them on NATS. The pickers get ``tokenizers`` as
    ``--tokenizer POOL=SPEC`` (precise prefix routing on those pools' events); a simulated pool
    given a tokenizer file gets it as ``lig sim --tokenizer`` too. Simulated pods report the
    prompt tokens they found cached, and with ``record_responses`` the pickers read every
    response (``lig picker --record-responses``), so that their outcome records are complete
    and their predicted/observed reuse counters move: a local stack is for seeing.
    """

    state_dir: str
    ports: Ports
    nats_url: str
    embedded_nats: bool
    pool: str
    registry_paths: list[str]
    envoy_config: str
    registry_endpoints_override: str | None = None  # the simulated pods, for the pool's list
    pods: list[Endpoint] = []
    pools: list[str] = []
    picker_pools: list[str] = []
    sims: list[SimulatedPool] = []
    sim_args: list[str] = []
    kv_events: bool = True
    kv_events_args: list[str] = []
    record_responses: bool = True
    tokenizers: dict[str, str] = {}  # pool -> the pickers' --tokenizer spec
    prefix: str = "lig"
    log_level: str = "INFO"
    prometheus: list[str] = []  # lig up --observe: the Prometheus command (none without it)

    def lig(self, *args: str) -> list[str]:
        """argv of a ``lig`` subcommand run by this Python."""
        return [sys.executable, "-m", "lig.cli", *args]

    def nats_flags(self) -> list[str]:
        return ["--nats-url", self.nats_url, "--prefix", self.prefix,
                "--log-level", self.log_level]

    def children(self) -> list[ChildSpec]:
        """The child processes in start order (NATS first, Envoy last)."""
        specs: list[ChildSpec] = []
        if self.embedded_nats:
            specs.append(ChildSpec("nats", [
                server_binary("nats-server"), "--addr", LOOPBACK,
                "--port", str(self.ports.nats), "--jetstream",
                "--store_dir", str(Path(self.state_dir) / "nats"), "--server_name", "lig-up",
            ]))
        for sim in self.sims:
            lora_flags = [flag for name in sim.adapters for flag in ("--lora", name)]
            specs.append(ChildSpec(self.sim_name(sim), self.lig(
                "sim", "--pods", str(len(sim.pods)), "--host", LOOPBACK,
                "--base-port", str(sim.pods[0].port), "--model", sim.model,
                *lora_flags, *self.sim_kv_events_flags(sim.pods[0].port),
                *self.sim_tokenizer_flags(sim),
                # Usage reports cached tokens, for the pickers' predicted/observed reuse.
                "--enable-prompt-tokens-details",
                "--log-level", self.log_level, *self.sim_args,
            )))
        override = (["--endpoints-override", self.registry_endpoints_override]
                    if self.registry_endpoints_override else [])
        specs.append(ChildSpec("registry", self.lig(
            "registry", *self.registry_paths, *override, "--host", LOOPBACK,
            "--metrics-port", str(self.ports.registry_metrics), *self.nats_flags(),
        )))
        specs.append(ChildSpec("collector", self.lig(
            "collector", "--host", LOOPBACK,
            "--metrics-port", str(self.ports.collector_metrics), *self.nats_flags(),
        )))
        if self.kv_events:
            specs.append(ChildSpec("kv-events", self.lig(
                "kv-events", "--host", LOOPBACK,
                "--metrics-port", str(self.ports.kv_events_metrics),
                "--events-port", f"{self.ports.kv_events_offset:+d}",
                "--replay-port", f"{self.ports.kv_replay_offset:+d}",
                *self.nats_flags(), *self.kv_events_args,
            )))
        for i, picker in enumerate(self.ports.pickers):
            specs.append(ChildSpec(f"picker-{i}", self.lig(
                "picker", *[flag for pool in self.picker_pools for flag in ("--pool", pool)],
                *[flag for pool, spec in self.tokenizers.items()
                  for flag in ("--tokenizer", f"{pool}={spec}")],
                "--host", LOOPBACK,
                "--grpc-port", str(picker.grpc), "--health-port", str(picker.health),
                "--metrics-port", str(picker.metrics),
                *(["--record-responses"] if self.record_responses else []), *self.nats_flags(),
            )))
        specs.append(ChildSpec("envoy", [
            server_binary("envoy"), "--config-path", self.envoy_config,
            "--disable-hot-restart", "--log-level", "warning",
        ]))
        if self.prometheus:
            specs.append(ChildSpec("prometheus", self.prometheus))
        return [ChildSpec(s.name, s.argv, {"PYTHONUNBUFFERED": "1"}) for s in specs]

    def sim_kv_events_flags(self, base_port: int) -> list[str]:
        """The ``lig sim`` flags that make pods from ``base_port`` on publish KV-cache events
        where ``lig kv-events`` looks for them (none without ``kv_events``)."""
        if not self.kv_events:
            return []
        events, replay = self.ports.kv_event_ports(base_port)
        config = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{events}", "replay_endpoint": f"tcp://*:{replay}"}
        return ["--kv-events-config", msgspec.json.encode(config).decode()]

    def sim_tokenizer_flags(self, sim: SimulatedPool) -> list[str]:
        """``lig sim --tokenizer`` when the pickers read a tokenizer file for ``sim``'s pool:
        the pods must tokenize as the pickers do (none for ``builtin:lig-sim``, their own)."""
        spec = self.tokenizers.get(sim.pool)
        if spec is None or spec.startswith("builtin:"):
            return []
        return ["--tokenizer", spec]

    def kv_event_ports(self) -> list[int]:
        """The KV-event PUB and replay ports of every simulated pod (none without
        ``kv_events``)."""
        if not self.kv_events:
            return []
        return [port for pod in self.pods for port in self.ports.kv_event_ports(pod.port)]

    def sim_name(self, sim: SimulatedPool) -> str:
        """The child name of ``sim``'s process: ``sim``, or ``sim-<pool>`` when there are
        several."""
        return "sim" if len(self.sims) == 1 else f"sim-{sim.pool}"

    def picker_metrics_urls(self) -> list[str]:
        return [f"http://{LOOPBACK}:{p.metrics}/metrics" for p in self.ports.pickers]

    def metrics_urls(self) -> dict[str, str]:
        """Every Prometheus endpoint of the stack by name: each service's, and each simulated
        pod's vLLM metrics (what a Prometheus scraping the stack reads)."""
        urls = {"registry": self.ports.registry_metrics,
                "collector": self.ports.collector_metrics}
        if self.kv_events:
            urls["kv-events"] = self.ports.kv_events_metrics
        urls.update({f"picker-{i}": p.metrics for i, p in enumerate(self.ports.pickers)})
        named = {name: f"http://{LOOPBACK}:{port}/metrics" for name, port in urls.items()}
        named.update({f"pod {pod.hostport}": f"http://{pod.hostport}/metrics" for pod in self.pods})
        return named

    def gateway_url(self) -> str:
        return f"http://{LOOPBACK}:{self.ports.gateway}"

    def prometheus_url(self) -> str:
        """Where ``lig up --observe``'s Prometheus serves its UI and API ("" without it)."""
        return f"http://{LOOPBACK}:{self.ports.prometheus}" if self.prometheus else ""


class StackInfo(msgspec.Struct, frozen=True):
    """What ``lig up`` writes to ``<state>/stack.json`` while it runs, for ``lig status``."""

    nats_url: str
    prefix: str
    pool: str
    gateway: str
    picker_metrics: list[str]
    pid: int
    ports: list[int] = []  # every port the stack's children listen on
    pools: list[str] = []  # every pool served (``pool`` is the first)
    metrics: dict[str, str] = {}  # every Prometheus endpoint by name (services and pods)
    prometheus: str = ""  # lig up --observe's Prometheus

    def write(self, state_dir: Path) -> Path:
        path = state_dir / STACK_FILE
        path.write_bytes(msgspec.json.encode(self))
        return path

    @classmethod
    def read(cls, state_dir: Path) -> StackInfo | None:
        """The running stack's info, or None if there is none (or the file is unreadable)."""
        try:
            return msgspec.json.decode((state_dir / STACK_FILE).read_bytes(), type=cls)
        except (OSError, msgspec.DecodeError):
            return None
