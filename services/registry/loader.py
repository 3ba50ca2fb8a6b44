"""Validating registry documents and converting them into the wire messages of ``shared.schemas``.

Input is a sequence of :class:`Document` (already-parsed YAML objects with where they came from),
so any source can feed the same validation: today the file source in :mod:`.files`, later a
Kubernetes watch. Checks, in order:

1. each document on its own: a mapping with a supported ``apiVersion`` and a known ``kind``,
   every field of :mod:`.crd` present and well-typed, endpoint addresses that are IPs inside the
   pool's allowed networks (:mod:`.networks`), no duplicate endpoints or target models inside
   the object, a scheduling policy that builds;
2. across documents, only when every document passed (otherwise a broken pool would also show up as
   "missing pool" noise): unique pool names (KV keys have no namespace, so across namespaces
   too), unique InferenceModel names per namespace, every ``poolRef`` naming a pool of the model's
   namespace, unique ``modelName`` per pool.

Every problem names its source, the document number (1-based, counting every ``---`` section), the
line when the source knows it, and the field path (``spec.targetModels[1].weight``).
"""

from __future__ import annotations

import ipaddress
import random
import re
import reprlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from scheduling import PolicyConfigError, build_policy
from services.registry import crd
from services.registry import networks as networks_module
from shared.errors import ConfigError
from shared.schemas import (
    Criticality,
    Endpoint,
    EndpointSet,
    InferenceModel,
    InferencePool,
    PolicyConfig,
    TargetModel,
)


class Problem(msgspec.Struct, frozen=True):
    """One reason the input is invalid, located as precisely as the source allows."""

    source: str
    message: str
    document: int | None = None
    line: int | None = None
    field: str | None = None

    def __str__(self) -> str:
        parts = [f"{self.source}:{self.line}" if self.line else self.source]
        if self.document is not None:
            parts.append(f"document {self.document}")
        if self.field:
            parts.append(self.field)
        parts.append(self.message)
        return ": ".join(parts)


class Document(msgspec.Struct, frozen=True):
    """One parsed object from a source; ``lines`` maps field paths to 1-based line numbers."""

    source: str
    index: int
    data: Any
    lines: Mapping[str, int] = {}

    def problem(self, message: str, field: str | None = None) -> Problem:
        """A problem in this document, at ``field`` (or the nearest enclosing field with a line)."""
        return Problem(self.source, message, self.index, self._line_of(field or ""), field)

    def where(self) -> str:
        """``source:line`` of the document's start, or ``source document N``."""
        line = self._line_of("")
        return f"{self.source}:{line}" if line else f"{self.source} document {self.index}"

    def _line_of(self, field: str) -> int | None:
        # The longest prefix of the path that the source has a line for.
        cuts = [i for i, char in enumerate(field) if char in ".["] + [len(field)]
        for cut in reversed(cuts):
            line = self.lines.get(field[:cut])
            if line is not None:
                return line
        return self.lines.get("")


class Registry(msgspec.Struct, frozen=True):
    """The desired registry state: what belongs in the KV bucket."""

    pools: tuple[InferencePool, ...] = ()
    models: tuple[InferenceModel, ...] = ()
    endpoint_sets: tuple[EndpointSet, ...] = ()


class InvalidRegistry(ConfigError):
    """The input has problems; nothing of it may be published."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(str(problem) for problem in self.problems))


class _Parsed(msgspec.Struct, frozen=True):
    document: Document
    obj: crd.PoolObject | crd.ModelObject


# Values quoted in problems are shortened: a document may hold a megabyte-long string, or a
# structure of aliases whose full repr would be far larger than the file.
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 80, 80

_PATH_IN_ERROR = re.compile(
    r"^(?P<message>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?$", re.DOTALL
)
_FIELD_IN_MESSAGE = re.compile(
    r"^Object (missing required|contains unknown) field `(?P<name>[^`]+)`"
)


def build_registry(documents: Iterable[Document], problems: Sequence[Problem] = ()) -> Registry:
    """Validate ``documents`` and convert them; raise :class:`InvalidRegistry` on any problem.

    ``problems`` are those the source already found (unreadable files, YAML syntax); they are
    reported together with the per-document ones.
    """
    found = list(problems)
    parsed: list[_Parsed] = []
    for document in documents:
        obj, document_problems = _parse(document)
        found += document_problems
        if obj is not None and not document_problems:
            parsed.append(_Parsed(document, obj))
    if not found:
        found += _cross_check(parsed)
    if found:
        raise InvalidRegistry(sorted(found, key=lambda p: (p.source, p.document or 0)))
    return _convert(parsed)


def _parse(document: Document) -> tuple[crd.PoolObject | crd.ModelObject | None, list[Problem]]:
    data = document.data
    if not isinstance(data, dict):
        kind_of = type(data).__name__
        return None, [document.problem(f"expected a mapping with apiVersion, kind, metadata and "
                                       f"spec, got {kind_of}")]
    kind = data.get("kind")
    object_type = crd.OBJECT_TYPES.get(kind) if isinstance(kind, str) else None
    if object_type is None:
        known = " or ".join(crd.OBJECT_TYPES)
        message = ("required field missing" if kind is None
                   else f"unknown kind {_SHORT.repr(kind)}")
        return None, [document.problem(f"{message} (expected {known})", "kind")]
    version = data.get("apiVersion")
    if version not in crd.API_VERSIONS:
        message = ("required field missing" if version is None
                   else f"unsupported {_SHORT.repr(version)}")
        return None, [document.problem(f"{message} (expected {' or '.join(crd.API_VERSIONS)})",
                                       "apiVersion")]
    try:
        obj = msgspec.convert(data, object_type)
    except msgspec.ValidationError as exc:
        return None, [_validation_problem(document, str(exc))]
    if isinstance(obj, crd.PoolObject):
        return obj, _check_pool(document, obj)
    return obj, _check_model(document, obj)


def _validation_problem(document: Document, error: str) -> Problem:
    """Turn msgspec's ``<message> - at `$.a.b[0]``` into a field path and a plain message."""
    match = _PATH_IN_ERROR.match(error)
    assert match is not None  # the pattern matches any string
    # msgspec writes a map's values as `[...]`; the map's own path is precise enough.
    message, path = match["message"], (match["path"] or "").lstrip(".").replace("[...]", "")
    if match["key"]:
        message += " as a mapping key"
    named = _FIELD_IN_MESSAGE.match(message)
    if named:
        path = f"{path}.{named['name']}" if path else named["name"]
        message = ("required field missing" if named.group(1) == "missing required"
                   else "unknown field")
    return document.problem(message, path or None)


def _check_pool(document: Document, pool: crd.PoolObject) -> list[Problem]:
    problems: list[Problem] = []
    names: set[str] = set()
    hostports: set[tuple[str, int]] = set()
    usable: list[int] = []  # endpoints whose address is then checked against allowedNetworks
    for i, endpoint in enumerate(pool.spec.endpoints or ()):
        at = f"spec.endpoints[{i}]"
        unusable = unusable_address(endpoint.address)
        if unusable:
            problems.append(document.problem(unusable, f"{at}.address"))
        else:
            usable.append(i)
        if endpoint.name in names:
            problems.append(document.problem(f"duplicate endpoint name {endpoint.name!r}",
                                             f"{at}.name"))
        hostport = (endpoint.address, endpoint.port or pool.spec.target_port_number)
        if hostport in hostports:
            problems.append(document.problem(
                f"duplicate endpoint address {hostport[0]}:{hostport[1]}", f"{at}.address"))
        names.add(endpoint.name)
        hostports.add(hostport)
    problems += _check_networks(document, pool, usable)
    scheduling = pool.spec.scheduling
    try:
        build_policy(PolicyConfig(scheduling.policy, scheduling.params), random.Random())
    except PolicyConfigError as exc:
        problems.append(document.problem(str(exc), "spec.scheduling"))
    return problems


_LIMITED_BROADCAST = ipaddress.IPv4Address("255.255.255.255")


def unusable_address(address: str) -> str | None:
    """Why requests cannot be sent to ``address``, or None if they can.

    Loopback is allowed: local stacks run their pods on 127.0.0.1.
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return (f"{_SHORT.repr(address)} is not an IP address (Envoy's original-destination "
                "cluster cannot resolve host names)")
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:0.0.0.0 is as unusable as 0.0.0.0
    if ip.is_unspecified:
        why = "the unspecified address (a listening address meaning any, not a pod's)"
    elif ip.is_multicast:
        why = "a multicast address"
    elif ip == _LIMITED_BROADCAST:
        why = "the broadcast address"
    else:
        return None
    return f"{address!r} is {why}; give the pod's own IP address"


def _check_networks(document: Document, pool: crd.PoolObject, usable: list[int]) -> list[Problem]:
    """Every endpoint of ``usable`` (indices of usable addresses) inside the pool's allowed
    networks (:mod:`.networks`)."""
    listed = pool.spec.allowed_networks
    networks, bad = networks_module.parse_networks(
        listed if listed is not None else networks_module.DEFAULT_ALLOWED_NETWORKS)
    problems = [document.problem(message, f"spec.allowedNetworks[{i}]") for i, message in bad]
    endpoints = pool.spec.endpoints or ()
    for i in usable:
        reason = networks_module.refusal(endpoints[i].address, networks,
                                         explicit=listed is not None)
        if reason is not None:
            problems.append(document.problem(reason, f"spec.endpoints[{i}].address"))
    return problems


def _check_model(document: Document, model: crd.ModelObject) -> list[Problem]:
    problems: list[Problem] = []
    names: set[str] = set()
    for i, target in enumerate(model.spec.target_models):
        if target.name in names:
            problems.append(document.problem(f"duplicate target model {target.name!r}",
                                             f"spec.targetModels[{i}].name"))
        names.add(target.name)
    return problems


def _cross_check(parsed: Sequence[_Parsed]) -> list[Problem]:
    problems: list[Problem] = []
    pools: dict[str, _Parsed] = {}
    model_objects: dict[tuple[str, str], _Parsed] = {}
    model_names: dict[tuple[str, str], _Parsed] = {}
    for item in parsed:
        if isinstance(item.obj, crd.PoolObject):
            first = pools.setdefault(item.obj.metadata.name, item)
            if first is not item:
                problems.append(item.document.problem(
                    f"duplicate InferencePool name (first defined at {first.document.where()})",
                    "metadata.name"))
    for item in parsed:
        model = item.obj
        if not isinstance(model, crd.ModelObject):
            continue
        meta = model.metadata
        first = model_objects.setdefault((meta.namespace, meta.name), item)
        if first is not item:
            problems.append(item.document.problem(
                f"duplicate InferenceModel name in namespace {meta.namespace!r} "
                f"(first defined at {first.document.where()})", "metadata.name"))
        pool = pools.get(model.spec.pool_ref.name)
        if pool is None:
            problems.append(item.document.problem(
                f"no InferencePool named {model.spec.pool_ref.name!r}", "spec.poolRef.name"))
            continue
        if pool.obj.metadata.namespace != meta.namespace:
            problems.append(item.document.problem(
                f"InferencePool {pool.obj.metadata.name!r} is in namespace "
                f"{pool.obj.metadata.namespace!r}, not in the model's {meta.namespace!r}",
                "spec.poolRef.name"))
        first = model_names.setdefault((pool.obj.metadata.name, model.spec.model_name), item)
        if first is not item:
            problems.append(item.document.problem(
                f"modelName {model.spec.model_name!r} is already served by pool "
                f"{pool.obj.metadata.name!r} (first defined at {first.document.where()})",
                "spec.modelName"))
    return problems


def _convert(parsed: Sequence[_Parsed]) -> Registry:
    pools: list[InferencePool] = []
    endpoint_sets: list[EndpointSet] = []
    models: list[InferenceModel] = []
    for item in parsed:
        obj = item.obj
        if isinstance(obj, crd.PoolObject):
            pools.append(_pool(obj))
            if obj.spec.endpoints is not None:
                endpoint_sets.append(endpoint_set(obj.metadata.name, obj.spec.endpoints,
                                                  obj.spec.target_port_number))
        else:
            models.append(_model(obj))
    return Registry(tuple(pools), tuple(models), tuple(endpoint_sets))


def _pool(obj: crd.PoolObject) -> InferencePool:
    spec = obj.spec
    return InferencePool(
        name=obj.metadata.name,
        target_port=spec.target_port_number,
        selector=dict(spec.selector),
        metrics_path=spec.metrics.path,
        metrics_port=spec.metrics.port,
        policy=PolicyConfig(spec.scheduling.policy, dict(spec.scheduling.params)),
        reject_unknown_models=spec.reject_unknown_models,
        objectives={name: Criticality(value) for name, value in sorted(spec.objectives.items())},
    )


def endpoint_set(pool: str, specs: Iterable[crd.EndpointSpec], port: int) -> EndpointSet:
    """``pool``'s listed endpoints; one without its own port gets the pool's ``port``."""
    return EndpointSet(
        pool=pool,
        endpoints=tuple(Endpoint(e.name, e.address, e.port or port, dict(e.labels))
                        for e in specs),
    )


def _model(obj: crd.ModelObject) -> InferenceModel:
    spec = obj.spec
    # Upstream: no targetModels means the model name itself is the target.
    targets = spec.target_models or [crd.TargetModelSpec(spec.model_name)]
    return InferenceModel(
        model_name=spec.model_name,
        pool=spec.pool_ref.name,
        criticality=crd.criticality(spec.criticality),
        target_models=tuple(TargetModel(t.name, t.weight) for t in targets),
    )
