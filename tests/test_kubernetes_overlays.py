"""The Kubernetes manifests and their overlays, checked offline: ``kubectl kustomize`` renders
each; every object validates against the Kubernetes OpenAPI schemas (kubernetes-validate) or its
CRD's schema (tests/fixtures/crd_schemas); the registry's RBAC is exactly what it reads; the
example InferencePool selects the simulator; the gateway overlay routes to the pool through the
picker; and the example objects publish the same models as the YAML ConfigMap."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from services.registry import kube_objects
from services.registry.files import FileSnapshot, SourceFile, load
from services.registry.kube_objects import KubeState
from services.registry.kube_source import RESOURCES
from tests.support.cli import parse_command

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
BASE = DEPLOY / "kubernetes"
DISCOVERY = DEPLOY / "kubernetes-overlays" / "discovery"
GATEWAY = DEPLOY / "kubernetes-overlays" / "gateway"
SCHEMAS = Path(__file__).parent / "fixtures" / "crd_schemas"
KUBERNETES_VERSION = "1.33"
READ = ["get", "list", "watch"]


@cache
def render(folder: Path) -> tuple[dict[str, Any], ...]:
    """``kubectl kustomize folder``, in a copy of deploy/ where the generators' inputs that are
    made at deploy time (secrets, not in git) are stand-ins, so every overlay renders offline."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with its built-in kustomize) is needed to render the overlays"
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "deploy"
        shutil.copytree(DEPLOY, copy)
        for kustomization in copy.rglob("kustomization.yaml"):
            stand_in_generator_inputs(kustomization)
        target = copy / folder.relative_to(DEPLOY)
        out = subprocess.run([kubectl, "kustomize", str(target)], capture_output=True,
                             text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {folder}: {out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def stand_in_generator_inputs(kustomization: Path) -> None:
    """Create the missing ``files``/``envs`` of its Secret and ConfigMap generators."""
    spec = yaml.safe_load(kustomization.read_text())
    for generator in spec.get("secretGenerator", []) + spec.get("configMapGenerator", []):
        for kind in ("files", "envs"):
            for entry in generator.get(kind, []):
                path = kustomization.parent / entry.split("=")[-1]
                if not path.exists():
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text("STAND_IN=1\n" if kind == "envs" else "stand-in\n")


def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    found = {}
    for path in SCHEMAS.glob("*.json"):
        doc = json.loads(path.read_text())
        found[(f"{doc['group']}/{doc['version']}", doc["kind"])] = doc["openAPIV3Schema"]
    return found


def one(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


@pytest.mark.parametrize("folder", [BASE, DISCOVERY, GATEWAY], ids=["base", "discovery", "gateway"])
def test_every_object_validates(folder: Path) -> None:
    schemas = crd_schemas()
    for doc in render(folder):
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        schema = schemas.get((doc["apiVersion"], doc["kind"]))
        try:
            if schema is not None:
                jsonschema.validate(doc, schema)
            else:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            raise AssertionError(f"{folder.name}: {where}: {exc}") from None
        except kubernetes_validate.SchemaNotFoundError:
            raise AssertionError(f"{folder.name}: {where}: no schema to validate it") from None


def test_the_schemas_reject_a_bad_pool() -> None:
    pool = one(render(DISCOVERY), "InferencePool", "vllm-llama3-8b-instruct")
    bad = json.loads(json.dumps(pool))
    bad["spec"]["targetPorts"] = [{"number": 8000 + i} for i in range(9)]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, crd_schemas()[(pool["apiVersion"], "InferencePool")])


@pytest.mark.parametrize("folder", [DISCOVERY, GATEWAY], ids=["discovery", "gateway"])
def test_registry_reads_the_api_with_exactly_the_rights_it_needs(folder: Path) -> None:
    docs = render(folder)
    registry = one(docs, "Deployment", "registry")["spec"]["template"]["spec"]
    container = registry["containers"][0]
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    command, args = parse_command(container["args"], env)
    assert command == "registry" and args.kubernetes and not args.paths
    account = registry["serviceAccountName"]
    namespace = one(docs, "Deployment", "registry")["metadata"]["namespace"]
    subject = {"kind": "ServiceAccount", "name": account, "namespace": namespace}
    binding = next(d for d in docs if d["kind"] == "RoleBinding" and subject in d["subjects"])
    assert one(docs, "ServiceAccount", account)["metadata"]["namespace"] == namespace
    role = one(docs, "Role", binding["roleRef"]["name"])
    granted = {(group, resource, tuple(rule["verbs"]))
               for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"]}
    needed = {(r._api_info.resource.group, r._api_info.plural, tuple(READ))
              for r in RESOURCES.values()}
    assert granted == needed
    assert not any(d["kind"] in ("ClusterRole", "ClusterRoleBinding") for d in docs)
    # The base (YAML ConfigMap source) gets no API rights at all.
    assert "serviceAccountName" not in one(render(BASE), "Deployment",
                                           "registry")["spec"]["template"]["spec"]


def test_the_pool_selects_the_simulator_and_names_the_picker() -> None:
    docs = render(DISCOVERY)
    pool = one(docs, "InferencePool", "vllm-llama3-8b-instruct")
    sim = one(docs, "Deployment", "vllm-sim")["spec"]["template"]
    labels = sim["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = sim["spec"]["containers"][0]["ports"]
    sim_ports = [p["containerPort"] for p in ports if not p.get("name", "").startswith("kv-")]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == sim_ports
    # kv-events finds each target port's event and replay sockets on the pod itself.
    kv_events = one(docs, "Deployment", "kv-events")["spec"]["template"]["spec"]["containers"][0]
    _, settings = parse_command(kv_events["args"])
    named = {p["containerPort"]: p.get("name") for p in ports}
    for index, target in enumerate(pool["spec"]["targetPorts"]):
        assert named[settings.events.port_for(target["number"])] == f"kv-events-{index}"
        assert named[settings.replay.port_for(target["number"])] == f"kv-replay-{index}"
    picker_ref = pool["spec"]["endpointPickerRef"]
    service = one(docs, "Service", picker_ref["name"])
    assert picker_ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    picker = one(docs, "Deployment", "picker")["spec"]["template"]["spec"]["containers"][0]
    assert "--grpc-port" in picker["args"]
    assert picker["args"][picker["args"].index("--grpc-port") + 1] == str(
        picker_ref["port"]["number"])


def test_the_gateway_overlay_routes_to_the_pool_without_our_envoy() -> None:
    docs = render(GATEWAY)
    assert not [d for d in docs if d["metadata"]["name"] in ("envoy", "lig-envoy")]
    route = one(docs, "HTTPRoute", "llm-route")
    (backend,) = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert (backend["group"], backend["kind"]) == ("inference.networking.k8s.io",
                                                   "InferencePool")
    assert one(docs, "InferencePool", backend["name"])
    assert one(render(DISCOVERY), "Deployment", "envoy")  # the other way in keeps it


def test_the_example_objects_publish_the_models_of_the_yaml_configmap() -> None:
    docs = render(DISCOVERY)
    state = KubeState()
    kinds = {"InferencePool": kube_objects.POOL, "InferenceObjective": kube_objects.OBJECTIVE,
             "InferenceModelRewrite": kube_objects.REWRITE}
    for doc in docs:
        if doc["kind"] in kinds:
            kube_objects.parse(kinds[doc["kind"]], doc)  # raises BadObject if rejected
            state.apply(kinds[doc["kind"]], doc)
    from_api = state.registry()
    configmap = one(render(BASE), "ConfigMap", "lig-registry")["data"]
    from_yaml = load(FileSnapshot(tuple(SourceFile(name, text)
                                        for name, text in sorted(configmap.items()))))
    assert sorted(from_api.models, key=lambda m: m.model_name) == sorted(
        from_yaml.models, key=lambda m: m.model_name)
    (api_pool,), (yaml_pool,) = from_api.pools, from_yaml.pools
    assert (api_pool.name, api_pool.policy, api_pool.metrics_path,
            api_pool.reject_unknown_models) == (yaml_pool.name, yaml_pool.policy,
                                                yaml_pool.metrics_path,
                                                yaml_pool.reject_unknown_models)
