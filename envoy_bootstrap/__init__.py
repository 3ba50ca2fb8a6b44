"""The Envoy bootstrap the project ships (``envoy.yaml``, package data) and its rendering for
given ports, picker replicas, TLS, response timeout and body mode; used by ``lig up``,
``deploy/render.py``, the tests and the benchmarks."""

from envoy_bootstrap.render import (
    BODY_MODES,
    DESTINATION_HEADER,
    PickerEndpoint,
    PickerTls,
    dump_envoy_config,
    envoy_config,
    ext_proc_filter,
    render_envoy_config,
    routing_filters,
    template_text,
    use_body_mode,
)

__all__ = [
    "BODY_MODES",
    "DESTINATION_HEADER",
    "PickerEndpoint",
    "PickerTls",
    "dump_envoy_config",
    "envoy_config",
    "ext_proc_filter",
    "render_envoy_config",
    "routing_filters",
    "template_text",
    "use_body_mode",
]
