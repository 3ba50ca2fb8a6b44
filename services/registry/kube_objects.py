"""Kubernetes objects read by ``lig registry --kubernetes``, checked one by one and turned into the
same :class:`~services.registry.loader.Registry` the YAML loader produces.

Kinds (field names as in the Gateway API Inference Extension's Go types, ``api/v1`` and
``apix/v1alpha2``):

``InferencePool`` (``inference.networking.k8s.io/v1``)
    ``spec.selector.matchLabels`` (required, at least one label; ``matchExpressions`` is not
    supported), ``spec.targetPorts[].number`` (1 to 8 ports, each 1..65535, no repeats: every
    port of a pod is a separate data-parallel endpoint), ``spec.endpointPickerRef`` (read by the
    gateway, not by us). Options the API does not carry come from annotations (:data:`ANNOTATIONS`).
``Pod`` (``v1``)
    a member of every pool of its namespace whose ``matchLabels`` its labels contain, while it has a
    ``Ready=True`` condition, a ``status.podIP`` and no ``metadata.deletionTimestamp``.
``InferenceObjective`` (``inference.networking.x-k8s.io/v1alpha2``)
    ``spec.priority`` (integer, optional) and ``spec.poolRef.name``. It applies to the model named
    by its annotation ``inference.lig.dev/model-name`` or else by its own name (object names
    cannot hold every model name: ``meta-llama/Llama-3.1-8B-Instruct``).
``InferenceModelRewrite`` (``inference.networking.x-k8s.io/v1alpha2``)
    ``spec.poolRef.name`` and ``spec.rules[]``: ``matches[].model`` (``type: Exact``, ``value``)
    and ``targets[]`` (``modelRewrite``, ``weight``).
``InferenceModel`` (``inference.networking.x-k8s.io/v1alpha2``, the seed's kind)
    ``spec.modelName``, ``spec.criticality``, ``spec.targetModels[]`` (``name``, ``weight``),
    ``spec.poolRef.name``.

Priority and criticality (``model.<pool>.<model>`` carries a criticality): priority < 0 is
Sheddable, 0 or unset is Standard, > 0 is Critical. A model name becomes a KV model entry when an
exact rewrite match or an objective names it; its targets come from the rewrite rule (else the
name itself) and its criticality from the objective of that name (else Standard).

A bad object is reported once per version (``rejected <Kind> ns/name: field: message``) and its
previous good version, if any, stays in use. Conflicts between good objects (two pools of one name
in different namespaces: KV keys carry no namespace; one model name defined twice in a pool) are
settled for the oldest object (creation time, then namespace/name) and logged.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable, Mapping
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from scheduling import PolicyConfigError, build_policy
from services.registry import crd
from services.registry import networks as networks_module
from services.registry.loader import Registry, unusable_address
from shared.errors import LigError
from shared.schemas import (
    DEFAULT_POLICY_NAME,
    Criticality,
    Endpoint,
    EndpointSet,
    InferenceModel,
    InferencePool,
    PolicyConfig,
    TargetModel,
)

log = logging.getLogger("lig.registry.kubernetes")

POOL = "InferencePool"
POD = "Pod"
OBJECTIVE = "InferenceObjective"
REWRITE = "InferenceModelRewrite"
MODEL = "InferenceModel"
KINDS = (POOL, POD, OBJECTIVE, REWRITE, MODEL)

ANNOTATION_PREFIX = "inference.lig.dev/"
ANNOTATIONS = {
    "metrics-path": "URL path the collector scrapes (default /metrics)",
    "metrics-port": "port the collector scrapes (default: each endpoint's own port)",
    "scheduling-policy": f"scheduling policy name (default {DEFAULT_POLICY_NAME})",
    "scheduling-params": "JSON object of the policy's parameters (default {})",
    "reject-unknown-models": "true: unknown model names get 404 (default false)",
    "allowed-networks": "comma-separated CIDRs pod IPs must lie in (default the private ranges)",
}
MODEL_NAME_ANNOTATION = f"{ANNOTATION_PREFIX}model-name"  # on an InferenceObjective
MAX_TARGET_PORTS = 8

Key = tuple[str, str, str]  # (kind, namespace, name)


class BadObject(LigError):
    """An object that cannot be used; ``field`` locates the problem."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")


class PodMember(msgspec.Struct, frozen=True):
    """What a pod contributes: its labels and, when it may serve, its IP."""

    name: str
    namespace: str
    labels: Mapping[str, str]
    ip: str | None


class PoolDef(msgspec.Struct, frozen=True):
    """A checked InferencePool."""

    namespace: str
    match_labels: Mapping[str, str]
    ports: tuple[int, ...]
    pool: InferencePool
    networks: tuple[networks_module.IPNetwork, ...] = ()
    networks_listed: bool = False  # from the annotation, not the defaults


class ModelDef(msgspec.Struct, frozen=True):
    """A model name defined for a pool (by an objective, a rewrite rule or an InferenceModel)."""

    namespace: str
    pool: str
    model_name: str
    criticality: Criticality | None = None
    targets: tuple[TargetModel, ...] = ()
    objective: str = ""  # the InferenceObjective's own name, when one defines it


class Parsed(msgspec.Struct, frozen=True):
    """A good object: when it was created (for conflicts) and what it defines."""

    created: str
    defines: PodMember | PoolDef | tuple[ModelDef, ...]


def parse(kind: str, obj: Mapping[str, Any]) -> Parsed:
    """Check one object of ``kind``; raise :class:`BadObject` when it cannot be used."""
    meta = obj.get("metadata") or {}
    created = str(meta.get("creationTimestamp") or "")
    namespace = str(meta.get("namespace") or "default")
    name = str(meta.get("name") or "")
    spec = obj.get("spec")
    if kind == POD:
        return Parsed(created, _pod(name, namespace, meta, obj.get("status") or {}))
    if not isinstance(spec, dict):
        raise BadObject("spec", "required field missing")
    if kind == POOL:
        return Parsed(created, _pool(name, namespace, meta, spec))
    if kind == OBJECTIVE:
        model_name = (meta.get("annotations") or {}).get(MODEL_NAME_ANNOTATION) or name
        return Parsed(created, (_objective(name, str(model_name), namespace, spec),))
    if kind == REWRITE:
        return Parsed(created, _rewrite(namespace, spec))
    return Parsed(created, (_seed_model(namespace, spec),))


def _pod(
    name: str, namespace: str, meta: Mapping[str, Any], status: Mapping[str, Any]
) -> PodMember:
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or () if isinstance(c, dict))
    ip = status.get("podIP")
    serving = ready and isinstance(ip, str) and ip and not meta.get("deletionTimestamp")
    return PodMember(name, namespace, labels, ip if serving else None)


def _convert(value: Any, into: type[Any], field: str) -> Any:
    try:
        return msgspec.convert(value, into)
    except msgspec.ValidationError as exc:
        raise BadObject(field, str(exc)) from None


def _pool(name: str, namespace: str, meta: Mapping[str, Any], spec: Mapping[str, Any]) -> PoolDef:
    selector = spec.get("selector")
    if not isinstance(selector, dict):
        raise BadObject("spec.selector", "required field missing")
    if selector.get("matchExpressions"):
        raise BadObject("spec.selector.matchExpressions", "not supported; use matchLabels")
    labels = _convert(selector.get("matchLabels") or {}, dict[str, str],
                      "spec.selector.matchLabels")
    if not labels:
        raise BadObject("spec.selector.matchLabels",
                        "no labels: a pool must select its pods by at least one label")
    ports = _convert(spec.get("targetPorts"), list[_PortSpec], "spec.targetPorts")
    if not 1 <= len(ports) <= MAX_TARGET_PORTS:
        raise BadObject("spec.targetPorts",
                        f"{len(ports)} ports (expected 1 to {MAX_TARGET_PORTS})")
    numbers = tuple(p.number for p in ports)
    if len(set(numbers)) != len(numbers):
        raise BadObject("spec.targetPorts", f"a port is listed twice: {list(numbers)}")
    annotations = meta.get("annotations") or {}
    options = {key.removeprefix(ANNOTATION_PREFIX): value for key, value in annotations.items()
               if key.startswith(ANNOTATION_PREFIX)}
    unknown = sorted(set(options) - set(ANNOTATIONS))
    if unknown:
        raise BadObject(f"metadata.annotations[{ANNOTATION_PREFIX}{unknown[0]}]",
                        f"unknown option (known: {', '.join(ANNOTATIONS)})")
    metrics = _convert({"path": options.get("metrics-path", "/metrics"),
                        "port": _int_option(options, "metrics-port")},
                       crd.MetricsSpec, "metadata.annotations")
    params = _json_option(options, "scheduling-params")
    policy = PolicyConfig(options.get("scheduling-policy", DEFAULT_POLICY_NAME), params)
    try:
        build_policy(policy, random.Random())
    except PolicyConfigError as exc:
        raise BadObject(f"metadata.annotations[{ANNOTATION_PREFIX}scheduling-policy]",
                        str(exc)) from None
    reject = options.get("reject-unknown-models", "false")
    if reject not in ("true", "false"):
        raise BadObject(f"metadata.annotations[{ANNOTATION_PREFIX}reject-unknown-models]",
                        f"{reject!r} is not true or false")
    listed = options.get("allowed-networks")
    cidrs = ([c.strip() for c in listed.split(",") if c.strip()] if listed is not None
             else list(networks_module.DEFAULT_ALLOWED_NETWORKS))
    networks, bad = networks_module.parse_networks(cidrs)
    if bad or not networks:
        raise BadObject(f"metadata.annotations[{ANNOTATION_PREFIX}allowed-networks]",
                        bad[0][1] if bad else "lists no network")
    _convert(name, crd.ObjectName, "metadata.name")
    pool = InferencePool(name=name, target_port=numbers[0], selector=dict(labels),
                         metrics_path=metrics.path, metrics_port=metrics.port, policy=policy,
                         reject_unknown_models=reject == "true")
    return PoolDef(namespace, labels, numbers, pool, tuple(networks), listed is not None)


def _int_option(options: Mapping[str, str], name: str) -> int | None:
    value = options.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise BadObject(f"metadata.annotations[{ANNOTATION_PREFIX}{name}]",
                        f"{value!r} is not an integer") from None


def _json_option(options: Mapping[str, str], name: str) -> dict[str, Any]:
    field = f"metadata.annotations[{ANNOTATION_PREFIX}{name}]"
    try:
        value = json.loads(options.get(name, "{}"))
    except json.JSONDecodeError as exc:
        raise BadObject(field, f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BadObject(field, "expected a JSON object")
    return value


class _PortSpec(msgspec.Struct, frozen=True):
    number: crd.Port


class _PoolRef(msgspec.Struct, frozen=True):
    name: crd.ObjectName
    group: str = ""
    kind: str = "InferencePool"


class _ObjectiveSpec(msgspec.Struct, frozen=True, rename="camel"):
    pool_ref: _PoolRef
    priority: int | None = None


class _ModelMatch(msgspec.Struct, frozen=True):
    value: crd.Name
    type: str = "Exact"


class _Match(msgspec.Struct, frozen=True):
    model: _ModelMatch


class _Target(msgspec.Struct, frozen=True, rename="camel"):
    model_rewrite: crd.Name
    weight: crd.Weight = 1


class _Rule(msgspec.Struct, frozen=True):
    matches: list[_Match] = []
    targets: Annotated[list[_Target], Meta(min_length=1)] = []


class _RewriteSpec(msgspec.Struct, frozen=True, rename="camel"):
    pool_ref: _PoolRef
    rules: list[_Rule] = []


class _SeedModelSpec(msgspec.Struct, frozen=True, rename="camel"):
    model_name: Annotated[str, Meta(min_length=1, max_length=256)]
    pool_ref: _PoolRef
    criticality: str | None = None
    target_models: Annotated[list[crd.TargetModelSpec], Meta(max_length=10)] = []


def criticality_of(priority: int | None) -> Criticality:
    """An InferenceObjective's priority as the criticality the KV model entry carries."""
    if priority is None or priority == 0:
        return Criticality.STANDARD
    return Criticality.SHEDDABLE if priority < 0 else Criticality.CRITICAL


def _objective(name: str, model_name: str, namespace: str, spec: Mapping[str, Any]) -> ModelDef:
    priority = spec.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise BadObject("spec.priority", f"unknown priority {priority!r} (expected an integer)")
    parsed = _convert(spec, _ObjectiveSpec, "spec")
    _check_pool_kind(parsed.pool_ref)
    return ModelDef(namespace, parsed.pool_ref.name, model_name, criticality_of(parsed.priority),
                    objective=name)


def _rewrite(namespace: str, spec: Mapping[str, Any]) -> tuple[ModelDef, ...]:
    parsed = _convert(spec, _RewriteSpec, "spec")
    _check_pool_kind(parsed.pool_ref)
    models: list[ModelDef] = []
    seen: set[str] = set()
    for i, rule in enumerate(parsed.rules):
        if not rule.matches:
            raise BadObject(f"spec.rules[{i}].matches", "a rule without matches (a wildcard "
                            "rewrite) is not supported: name the models")
        for j, match in enumerate(rule.matches):
            if match.model.type != "Exact":
                raise BadObject(f"spec.rules[{i}].matches[{j}].model.type",
                                f"unsupported match type {match.model.type!r} (expected Exact)")
            if match.model.value in seen:
                raise BadObject(f"spec.rules[{i}].matches[{j}].model.value",
                                f"model {match.model.value!r} matched twice")
            seen.add(match.model.value)
            targets = tuple(TargetModel(t.model_rewrite, t.weight) for t in rule.targets)
            models.append(ModelDef(namespace, parsed.pool_ref.name, match.model.value,
                                   targets=targets))
    return tuple(models)


def _seed_model(namespace: str, spec: Mapping[str, Any]) -> ModelDef:
    parsed = _convert(spec, _SeedModelSpec, "spec")
    _check_pool_kind(parsed.pool_ref)
    try:
        criticality = crd.criticality(parsed.criticality)
    except ValueError:
        raise BadObject("spec.criticality", f"unknown criticality {parsed.criticality!r} (expected "
                        "Critical, Standard or Sheddable)") from None
    targets = tuple(TargetModel(t.name, t.weight) for t in parsed.target_models)
    return ModelDef(namespace, parsed.pool_ref.name, parsed.model_name, criticality,
                    targets or (TargetModel(parsed.model_name),))


def _check_pool_kind(ref: _PoolRef) -> None:
    if ref.kind != "InferencePool":
        raise BadObject("spec.poolRef.kind", f"{ref.kind!r} is not InferencePool")


class KubeState:
    """The watched objects: raw versions for change detection, last good parses for building."""

    def __init__(self) -> None:
        self._versions: dict[Key, str] = {}
        self._good: dict[Key, Parsed] = {}
        self._conflicts: frozenset[str] = frozenset()
        self.rejected: set[Key] = set()  # objects whose newest version is bad
        self.generation = 0

    def apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        """An object was added or modified."""
        key = _key(kind, obj)
        version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        if self._versions.get(key) == version and key in self._versions:
            return
        self._versions[key] = version
        try:
            parsed = parse(kind, obj)
        except BadObject as exc:
            kept = ("its previous good version stays in use" if key in self._good
                    else "it is not used")
            log.error("rejected %s %s/%s (resourceVersion %s): %s; %s", kind, key[1], key[2],
                      version, exc, kept)
            self.rejected.add(key)
            self.generation += 1
            return
        if key in self.rejected:
            self.rejected.discard(key)
            self.generation += 1
        if self._good.get(key) != parsed:
            self._good[key] = parsed
            self.generation += 1

    def delete(self, kind: str, obj: Mapping[str, Any]) -> None:
        """An object was deleted."""
        key = _key(kind, obj)
        self._versions.pop(key, None)
        if key in self.rejected:
            self.rejected.discard(key)
            self.generation += 1
        if self._good.pop(key, None) is not None:
            self.generation += 1

    def replace(self, kind: str, objects: Iterable[Mapping[str, Any]]) -> None:
        """A fresh list of every object of ``kind``: apply it, delete what it lacks."""
        listed = set()
        for obj in objects:
            listed.add(_key(kind, obj))
            self.apply(kind, obj)
        for key in [k for k in self._versions if k[0] == kind and k not in listed]:
            self.delete(kind, {"metadata": {"namespace": key[1], "name": key[2]}})

    def registry(self) -> Registry:
        """The desired registry built from the good objects."""
        conflicts: list[str] = []
        pools: dict[str, PoolDef] = {}
        by_age = sorted(self._good.items(), key=lambda item: (item[1].created, item[0][1:]))
        for key, parsed in by_age:
            if not isinstance(parsed.defines, PoolDef):
                continue
            first = pools.setdefault(parsed.defines.pool.name, parsed.defines)
            if first is not parsed.defines:
                conflicts.append(f"InferencePool {key[1]}/{key[2]} ignored: pool name in use in "
                                 f"namespace {first.namespace} (KV keys carry no namespace)")
        pods = [p.defines for p in self._good.values()
                if isinstance(p.defines, PodMember) and p.defines.ip]
        endpoint_sets = tuple(_members(pool, pods, conflicts) for pool in pools.values())
        models = _models(pools, by_age, conflicts)
        if frozenset(conflicts) != self._conflicts:
            for line in sorted(set(conflicts) - self._conflicts):
                log.warning("conflict: %s", line)
            self._conflicts = frozenset(conflicts)
        return Registry(tuple(sorted((_with_objectives(p, by_age) for p in pools.values()),
                                     key=lambda p: p.name)),
                        models, tuple(sorted(endpoint_sets, key=lambda e: e.pool)))


def _with_objectives(pool: PoolDef, by_age: Iterable[tuple[Key, Parsed]]) -> InferencePool:
    """The pool's message with the criticality of each InferenceObjective of its namespace
    that names it (for the objective request header)."""
    # Sorted: the message's bytes must not depend on the order objects were seen in.
    objectives = dict(sorted(
        (model.objective, model.criticality)
        for _, parsed in by_age if isinstance(parsed.defines, tuple)
        for model in parsed.defines
        if model.objective and model.pool == pool.pool.name and model.namespace == pool.namespace
        and model.criticality is not None))
    return msgspec.structs.replace(pool.pool, objectives=objectives) if objectives else pool.pool


def _key(kind: str, obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return kind, str(meta.get("namespace") or "default"), str(meta.get("name") or "")


def _members(pool: PoolDef, pods: Iterable[PodMember], refused: list[str]) -> EndpointSet:
    """The pool's endpoints: its selected, serving pods whose IPs lie in its allowed networks
    (each pod left out for its address is added to ``refused``)."""
    endpoints: list[Endpoint] = []
    for pod in sorted(pods, key=lambda p: p.name):
        if pod.namespace != pool.namespace or pod.ip is None:
            continue
        if any(pod.labels.get(k) != v for k, v in pool.match_labels.items()):
            continue
        why = unusable_address(pod.ip) or networks_module.refusal(
            pod.ip, pool.networks, explicit=pool.networks_listed,
            setting=f"the {ANNOTATION_PREFIX}allowed-networks annotation")
        if why is not None:
            refused.append(f"Pod {pod.namespace}/{pod.name} left out of pool "
                           f"{pool.pool.name}: {why}")
            continue
        for rank, port in enumerate(pool.ports):
            # One port keeps the pod's name; several make one endpoint per port (rank as upstream).
            name = pod.name if len(pool.ports) == 1 else f"{pod.name}-rank-{rank}"
            endpoints.append(Endpoint(name, pod.ip, port, dict(pod.labels)))
    return EndpointSet(pool.pool.name, tuple(endpoints))


def _models(
    pools: Mapping[str, PoolDef], by_age: Iterable[tuple[Key, Parsed]], conflicts: list[str]
) -> tuple[InferenceModel, ...]:
    """Merge objectives (criticality) with rewrites and seed models (targets) per model name."""
    criticality: dict[tuple[str, str], Criticality] = {}
    targets: dict[tuple[str, str], tuple[TargetModel, ...]] = {}
    owner: dict[tuple[str, str, str], Key] = {}
    for key, parsed in by_age:
        if not isinstance(parsed.defines, tuple):
            continue
        for model in parsed.defines:
            pool = pools.get(model.pool)
            if pool is None or pool.namespace != model.namespace:
                continue  # pool missing (or another namespace's): published once it appears
            slot = (model.pool, model.model_name)
            role = "criticality" if model.criticality is not None else "targets"
            roles = ("criticality", "targets") if key[0] == MODEL else (role,)
            taken = [owner[(*slot, r)] for r in roles if (*slot, r) in owner]
            if taken:
                conflicts.append(f"{key[0]} {key[1]}/{key[2]} ignored for model "
                                 f"{model.model_name!r} of pool {model.pool}: already defined "
                                 f"by {taken[0][0]} {taken[0][1]}/{taken[0][2]}")
                continue
            for r in roles:
                owner[(*slot, r)] = key
            if model.criticality is not None:
                criticality[slot] = model.criticality
            if model.targets:
                targets[slot] = model.targets
    return tuple(
        InferenceModel(model_name=name, pool=pool,
                       criticality=criticality.get((pool, name), Criticality.STANDARD),
                       target_models=targets.get((pool, name), (TargetModel(name),)))
        for pool, name in sorted(set(criticality) | set(targets))
    )
