"""The Gateway API Inference Extension conformance suite's test hooks (``lig picker
--conformance-test-headers``, off by default).

The suite (``conformance/`` of kubernetes-sigs/gateway-api-inference-extension) checks a gateway,
not a picker: it steers each request to chosen model servers through its test endpoint picker and
checks which one served it. Its test pickers (the reference EPP's ``header-based-testing-filter``
and the lightweight EPP) read:

- request header ``test-epp-endpoint-selection``: comma-separated endpoints, each ``IP`` (every
  port of that address) or ``IP:port`` (that one; IPv6 in brackets), to pick among;
- and answer the response headers with ``x-conformance-test-served-endpoint``: the endpoint the
  gateway reports as having served the request (``envoy.lb`` ->
  ``x-gateway-destination-endpoint-served``), or a ``fail: ...`` text naming what was missing.

With the flag on, any client chooses its pod, which is why it is never on by default. Entries
that are no member of the pool are left out, as the reference filter does (the suite lists pods of
two pools to two pickers); when none is a member the request is refused (400
``test_endpoint_not_in_pool``): the selection names pods, never addresses outside the pool.

Pure functions over protobuf messages and registry structs; no network.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from services.picker import epp
from shared.schemas import Endpoint

SELECTION_HEADER = "test-epp-endpoint-selection"
SERVED_HEADER = "x-conformance-test-served-endpoint"
# The reference EPP's values when the gateway did not report the served endpoint.
MISSING_NAMESPACE = b"fail: missing envoy lb metadata"
MISSING_SERVED = b"fail: missing destination endpoint served metadata"


class Selection(msgspec.Struct, frozen=True):
    """A parsed ``test-epp-endpoint-selection`` header."""

    hosts: frozenset[str]  # bare addresses: every port of each
    hostports: frozenset[tuple[str, str]]  # (address, port): exactly that endpoint
    text: str  # as sent, for the error message

    def members(self, endpoints: Iterable[Endpoint]) -> frozenset[str]:
        """The ``ip:port`` of every endpoint in ``endpoints`` the selection names."""
        chosen = set()
        for endpoint in endpoints:
            address = endpoint.address.strip("[]")
            if address in self.hosts or (address, str(endpoint.port)) in self.hostports:
                chosen.add(endpoint.hostport)
        return frozenset(chosen)


def _entry(item: str) -> tuple[str, str | None]:
    """``(address, port)`` of one entry (port None: a bare address)."""
    if item.startswith("["):  # [IPv6] or [IPv6]:port
        address, _, rest = item[1:].partition("]")
        return address, rest[1:] if rest.startswith(":") and rest[1:] else None
    if item.count(":") == 1:  # IPv4:port (a bare IPv6 address has several colons)
        address, _, port = item.partition(":")
        return address, port or None
    return item, None


def selection(headers: pb.HttpHeaders) -> Selection | None:
    """The request's endpoint selection (None: no header, or an empty one)."""
    for header in headers.headers.headers:
        if header.key == SELECTION_HEADER:
            text = (header.raw_value or header.value.encode()).decode(errors="replace")
            hosts: set[str] = set()
            hostports: set[tuple[str, str]] = set()
            for item in text.split(","):
                if not item.strip():
                    continue
                address, port = _entry(item.strip())
                if port is None:
                    hosts.add(address)
                else:
                    hostports.add((address, port))
            if not hosts and not hostports:
                return None
            return Selection(frozenset(hosts), frozenset(hostports), text)
    return None


def served_value(metadata: base_pb2.Metadata) -> bytes:
    """The ``x-conformance-test-served-endpoint`` value: the endpoint the gateway reports as
    having served the request, else what it left out (the reference EPP's wording)."""
    namespace = metadata.filter_metadata.get(epp.LB_NAMESPACE)
    if namespace is None:
        return MISSING_NAMESPACE
    served = epp.served_endpoint(metadata)
    return served.encode() if served is not None else MISSING_SERVED
