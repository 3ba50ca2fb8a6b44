"""Render the shipped Envoy bootstrap (``envoy.yaml`` in this package) for other ports and pickers.

The template is a working configuration on its own; this fills in the listener and admin
addresses, the picker replicas (gRPC and health ports each) and the destination header name, so
that ``lig up``, ``deploy/render.py``, the tests and the benchmarks run the very configuration
the project ships. Default ports are those of :mod:`shared.ports`.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Sequence
from functools import cache
from typing import Any

import msgspec
import yaml

from shared import ports

DESTINATION_HEADER = "x-gateway-destination-endpoint"
# The second routing filter, for requests whose picker failed before routing them.
FALLBACK_FILTER = "lig.routing_fallback"
# How the routing filter sends bodies to the picker (``body_mode``): BUFFERED (the shipped one,
# measured fastest: bench/bench_picker.py --body-mode), STREAMED (the picker turns the request
# body into BUFFERED with a mode override), FULL_DUPLEX_STREAMED (as Gateway API gateways and
# llm-d run an endpoint picker: request and response bodies stream through the picker).
BODY_MODES = ("BUFFERED", "STREAMED", "FULL_DUPLEX_STREAMED")


class PickerEndpoint(msgspec.Struct, frozen=True):
    """Where Envoy reaches one picker replica (``host`` may be a DNS name)."""

    host: str
    grpc_port: int = ports.PICKER_GRPC
    health_port: int = ports.PICKER_HEALTH


class PickerTls(msgspec.Struct, frozen=True):
    """Envoy to pickers over TLS: the CA that signed the pickers' certificates, and Envoy's own
    certificate and key for pickers that require client certificates (``--tls-client-ca``)."""

    ca: str
    cert: str | None = None
    key: str | None = None


@cache
def template_text() -> str:
    """The shipped bootstrap template, read as package data (works from a wheel too)."""
    return importlib.resources.files(__package__).joinpath("envoy.yaml").read_text()


def envoy_config(
    *,
    pickers: Sequence[PickerEndpoint | tuple[str, int, int]],
    listener_port: int = ports.GATEWAY,
    admin_port: int = ports.ENVOY_ADMIN,
    listener_host: str = "0.0.0.0",
    admin_host: str = "127.0.0.1",
    destination_header: str = DESTINATION_HEADER,
    picker_tls: PickerTls | None = None,
    response_timeout: float | None = None,
    body_mode: str = "BUFFERED",
) -> dict[str, Any]:
    """The bootstrap as a dict; pickers as :class:`PickerEndpoint` or ``(host, grpc, health)``.

    ``response_timeout``: seconds a model server may send nothing (before its response starts,
    or within a stream) before Envoy answers 504; None keeps the template's (120 s).
    ``body_mode``: one of :data:`BODY_MODES` for the routing filter (see :func:`use_body_mode`).
    """
    if not pickers:
        raise ValueError("Envoy needs at least one picker")
    endpoints = [p if isinstance(p, PickerEndpoint) else PickerEndpoint(*p) for p in pickers]
    config = yaml.safe_load(template_text())
    config["admin"]["address"]["socket_address"] = {"address": admin_host,
                                                     "port_value": admin_port}
    resources = config["static_resources"]
    gateway = _named(resources["listeners"], "gateway")
    gateway["address"]["socket_address"] = {"address": listener_host,
                                             "port_value": listener_port}
    model_servers = _named(resources["clusters"], "model_servers")
    model_servers["original_dst_lb_config"]["http_header_name"] = destination_header
    removals = _gateway_filter(config, "envoy.filters.http.header_mutation")["mutations"][
        "request_mutations"]
    for removal in removals:
        if removal.get("remove") == DESTINATION_HEADER:
            removal["remove"] = destination_header
    fallback = _gateway_filter(config, FALLBACK_FILTER)["xds_matcher"]["matcher_list"]["matchers"]
    fallback[0]["predicate"]["single_predicate"]["input"]["typed_config"]["header_name"] = (
        destination_header)
    picker = _named(resources["clusters"], "picker")
    picker["load_assignment"]["endpoints"] = [{"lb_endpoints": [
        {"endpoint": {
            "address": {"socket_address": {"address": p.host, "port_value": p.grpc_port}},
            "health_check_config": {"port_value": p.health_port},
        }}
        for p in endpoints
    ]}]
    if picker_tls is not None:
        _use_tls(picker, picker_tls)
    if response_timeout is not None:
        if response_timeout <= 0:
            raise ValueError("the response timeout must be positive")
        route = _named(_gateway_manager(config)["route_config"]["virtual_hosts"],
                       "model_servers")["routes"][0]["route"]
        route["retry_policy"]["per_try_idle_timeout"] = f"{response_timeout:g}s"
    use_body_mode(config, body_mode)
    return config


def use_body_mode(config: dict[str, Any], body_mode: str) -> None:
    """Set the routing filter's body mode. FULL_DUPLEX_STREAMED also streams the response
    through the routing stream (headers, body and trailers SEND, as the Inference Extension's
    gateways configure it; Envoy allows no mode override then). The response-rewrite filter
    stays in every mode: in FULL_DUPLEX_STREAMED the picker puts the requested name back too,
    but a picker that dies mid-response lets the rest through unchanged (failure_mode_allow),
    and only Envoy's own rewrite then restores it."""
    if body_mode not in BODY_MODES:
        raise ValueError(f"unknown body mode {body_mode!r}; one of {', '.join(BODY_MODES)}")
    for routing in routing_filters(config):
        mode = routing["processing_mode"]
        mode["request_body_mode"] = body_mode
        if body_mode != "FULL_DUPLEX_STREAMED":
            continue
        mode.update(response_header_mode="SEND", response_body_mode=body_mode,
                    request_trailer_mode="SEND", response_trailer_mode="SEND")
        routing["allow_mode_override"] = False


def _use_tls(cluster: dict[str, Any], tls: PickerTls) -> None:
    """ext_proc streams over TLS (ALPN h2); health checks stay on the plaintext health port."""
    context: dict[str, Any] = {"alpn_protocols": ["h2"],
                               "validation_context": {"trusted_ca": {"filename": tls.ca}}}
    if tls.cert is not None and tls.key is not None:
        context["tls_certificates"] = [{"certificate_chain": {"filename": tls.cert},
                                        "private_key": {"filename": tls.key}}]
    cluster["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3"
                 ".UpstreamTlsContext",
        "common_tls_context": context}}
    cluster["transport_socket_matches"] = [{
        "name": "plaintext-health", "match": {"lig-health": "plaintext"},
        "transport_socket": {"name": "envoy.transport_sockets.raw_buffer", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3"
                     ".RawBuffer"}}}]
    for check in cluster["health_checks"]:
        check["transport_socket_match_criteria"] = {"lig-health": "plaintext"}


def render_envoy_config(**options: Any) -> str:
    """The bootstrap as YAML text; takes the arguments of :func:`envoy_config`."""
    return dump_envoy_config(envoy_config(**options))


def dump_envoy_config(config: dict[str, Any]) -> str:
    """``config`` as YAML text for Envoy's ``--config-path`` (a ``.yaml`` file)."""
    return yaml.dump(config, Dumper=_NoAliases, sort_keys=False)


class _NoAliases(yaml.SafeDumper):
    """Writes the template's shared parts (YAML anchors) out in full, and multi-line strings
    (the response-rewrite filter's Lua script) as ``|`` blocks: plainer to read."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_NoAliases.add_representer(
    str, lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def ext_proc_filter(config: dict[str, Any]) -> dict[str, Any]:
    """The ext_proc filter's ``typed_config`` inside ``config`` (to adjust processing modes)."""
    return _gateway_filter(config, "envoy.filters.http.ext_proc")


def routing_filters(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``typed_config`` of both ext_proc filters inside ``config``: the routing filter and
    the fallback that routes again a request whose picker failed before answering."""
    fallback = _gateway_filter(config, FALLBACK_FILTER)["extension_config"]["typed_config"]
    return ext_proc_filter(config), fallback


def _gateway_filter(config: dict[str, Any], name: str) -> dict[str, Any]:
    return _named(_gateway_manager(config)["http_filters"], name)["typed_config"]


def _gateway_manager(config: dict[str, Any]) -> dict[str, Any]:
    gateway = _named(config["static_resources"]["listeners"], "gateway")
    return gateway["filter_chains"][0]["filters"][0]["typed_config"]


def _named(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for item in items:
        if item.get("name") == name:
            return item
    raise KeyError(f"Envoy configuration has no {name!r}")
