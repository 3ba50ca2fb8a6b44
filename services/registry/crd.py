"""The registry's input format: ``InferencePool`` and ``InferenceModel`` objects as YAML.

The objects have the shape of the Kubernetes Gateway API Inference Extension CRDs
(``inference.networking.x-k8s.io`` ``v1alpha1``/``v1alpha2``: ``apiVersion``, ``kind``,
``metadata``, ``spec`` with camelCase fields), so the same files can later be applied to a cluster.
Upstream field names are used wherever upstream has the field:

``InferencePool.spec``
    ``selector`` (map of labels, required), ``targetPortNumber`` (1..65535, required) and, from
    v1alpha2, ``extensionRef`` (accepted and ignored: it tells the gateway where the picker is).
    Local extensions, which a cluster would prune: ``endpoints: [{name, address, port, labels}]``
    (explicit members; ``port`` defaults to ``targetPortNumber``; ``address`` must be an IP because
    Envoy's original-destination cluster cannot resolve names), ``metrics: {path, port}`` (where
    the collector scrapes; defaults ``/metrics`` on the serving port), ``scheduling: {policy,
    params}`` (default ``prefix-aware``, ``shared.schemas.DEFAULT_POLICY_NAME``, with its default
    parameters), ``rejectUnknownModels`` (default false: unknown model names pass through
    unchanged) and ``allowedNetworks`` (CIDRs the endpoint addresses must lie in; default the
    private ranges, see :mod:`services.registry.networks`).

``InferenceModel.spec``
    ``modelName`` (required), ``criticality`` (``Critical`` | ``Standard`` | ``Sheddable``, default
    ``Standard``; v1alpha1's ``Default`` is read as ``Standard``), ``targetModels: [{name,
    weight}]`` (at most 10; integer weights 1..1,000,000, default 1; none means the model itself),
    ``poolRef: {name}`` (required; ``group``/``kind`` may be given but must name an InferencePool).

Unknown fields in ``spec`` are errors (they are usually typos); unknown ``metadata`` fields are
ignored so that ``kubectl get -o yaml`` output can be read back. Cross-object rules (a model's pool
exists, names are unique) and the conversion to wire messages live in :mod:`.loader`.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta

from shared.schemas import DEFAULT_POLICY_NAME, Criticality

API_GROUP: Final = "inference.networking.x-k8s.io"
API_VERSIONS = (f"{API_GROUP}/v1alpha1", f"{API_GROUP}/v1alpha2")
POOL_KIND: Final = "InferencePool"
MODEL_KIND = "InferenceModel"

# A Kubernetes object name (DNS-1123 subdomain), so that a cluster accepts the same files.
ObjectName = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
    ),
]
Port = Annotated[int, Meta(ge=1, le=65535)]
Weight = Annotated[int, Meta(ge=1, le=1_000_000)]
Name = Annotated[str, Meta(min_length=1, max_length=253)]
UrlPath = Annotated[str, Meta(pattern=r"^/")]


class ObjectMeta(msgspec.Struct, frozen=True):
    """The part of Kubernetes ``metadata`` the registry reads; other fields are ignored."""

    name: ObjectName
    namespace: str = "default"


class EndpointSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One explicitly listed model-server pod (local extension)."""

    name: Name
    address: str
    port: Port | None = None
    labels: dict[str, str] = {}


class MetricsSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the collector scrapes each pod (local extension)."""

    path: UrlPath = "/metrics"
    port: Port | None = None


class SchedulingSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The pool's scheduling policy and its parameters (local extension)."""

    policy: Name = DEFAULT_POLICY_NAME
    params: dict[str, Any] = {}


class InferencePoolSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    """``InferencePool.spec``: upstream fields plus the local extensions."""

    selector: dict[str, str]
    target_port_number: Port
    extension_ref: dict[str, Any] | None = None
    endpoints: list[EndpointSpec] | None = None
    metrics: MetricsSpec = MetricsSpec()
    scheduling: SchedulingSpec = SchedulingSpec()
    reject_unknown_models: bool = False
    allowed_networks: list[str] | None = None
    # Named objectives for the x-gateway-inference-objective header (the file source's form of
    # InferenceObjectives): name -> criticality.
    objectives: Annotated[dict[Annotated[str, Meta(min_length=1, max_length=253)],
                               Literal["Critical", "Standard", "Sheddable"]],
                          Meta(max_length=1000)] = {}


class PoolObject(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    """A whole ``InferencePool`` document."""

    api_version: str
    kind: str
    metadata: ObjectMeta
    spec: InferencePoolSpec
    status: Any = None


class TargetModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A model or LoRA adapter receiving ``weight`` / (sum of weights) of the traffic."""

    name: Name
    weight: Weight = 1


class PoolRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``InferenceModel.spec.poolRef``: the pool in the model's namespace."""

    name: ObjectName
    group: Literal["inference.networking.x-k8s.io"] = API_GROUP
    kind: Literal["InferencePool"] = POOL_KIND


class InferenceModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    """``InferenceModel.spec``."""

    model_name: Annotated[str, Meta(min_length=1, max_length=256)]
    pool_ref: PoolRef
    criticality: Literal["Critical", "Standard", "Sheddable", "Default"] | None = None
    target_models: Annotated[list[TargetModelSpec], Meta(max_length=10)] = []


def criticality(value: str | None) -> Criticality:
    """A model's ``spec.criticality`` as the registry publishes it: unset and ``Default`` (the
    upstream CRD's spelling of unset) are Standard. ValueError for any other unknown value."""
    return Criticality.STANDARD if value in (None, "Default") else Criticality(value)


class ModelObject(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    """A whole ``InferenceModel`` document."""

    api_version: str
    kind: str
    metadata: ObjectMeta
    spec: InferenceModelSpec
    status: Any = None


OBJECT_TYPES: dict[str, type[PoolObject] | type[ModelObject]] = {
    POOL_KIND: PoolObject,
    MODEL_KIND: ModelObject,
}
