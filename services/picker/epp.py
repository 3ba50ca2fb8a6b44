"""The endpoint picker protocol (Gateway API Inference Extension proposal 004, v1.0.0): the names
and the parsing of what a Gateway API gateway tells its endpoint picker over ext_proc.

- Subset hint (request): filter metadata ``envoy.lb.subset_hint`` ->
  ``x-gateway-destination-endpoint-subset``, a list of ``ip:port``; the picker picks only among
  them (none eligible, or an empty list: 503).
- Destination (answer): the ``x-gateway-destination-endpoint`` header and dynamic metadata
  ``envoy.lb`` -> same key, both ``primary,fallback,...``.
- Served endpoint (response): filter metadata ``envoy.lb`` ->
  ``x-gateway-destination-endpoint-served``, the ``ip:port`` that actually answered.
- Objective (request header): ``x-gateway-inference-objective`` (or llm-d's
  ``x-llm-d-inference-objective``) names an InferenceObjective.
- Request id (request header): ``x-request-id``, which Envoy (and Gateway API gateways built on
  it) generates when the client sent none; the picker quotes it in its decision records.

Pure functions over protobuf messages; no network.
"""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from scheduling.record import recorded_request_id

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
OBJECTIVE_HEADERS = ("x-gateway-inference-objective", "x-llm-d-inference-objective")
REQUEST_ID_HEADER = "x-request-id"


def subset_hint(metadata: base_pb2.Metadata) -> frozenset[str] | None:
    """The gateway's subset hint (``ip:port`` set), or None when it sent none.

    The proposal's value is a list; a single string (comma-separated) is accepted too, as some
    gateways set metadata from a header. An empty set means: nothing is eligible.
    """
    namespace = metadata.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items = [item.string_value for item in value.list_value.values]
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        items = []
    return frozenset(item.strip() for item in items if item.strip())


def served_endpoint(metadata: base_pb2.Metadata) -> str | None:
    """The ``ip:port`` the gateway reports as having served the request (None: not reported)."""
    namespace = metadata.filter_metadata.get(LB_NAMESPACE)
    if namespace is None:
        return None
    value = namespace.fields.get(SERVED_KEY)
    if value is None or not value.string_value:
        return None
    return value.string_value.strip()


def objective(headers: pb.HttpHeaders) -> str | None:
    """The InferenceObjective the request names in its headers (the first header present)."""
    for header in headers.headers.headers:
        if header.key in OBJECTIVE_HEADERS:
            value = (header.raw_value or header.value.encode()).decode(errors="replace").strip()
            return value or None
    return None


def request_id(headers: pb.HttpHeaders) -> str:
    """The request's ``x-request-id`` as records keep it (:func:`~scheduling.record.
    recorded_request_id`: at most 200 bytes); "" when absent."""
    for header in headers.headers.headers:
        if header.key == REQUEST_ID_HEADER:
            return recorded_request_id(header.raw_value or header.value.encode())
    return ""
