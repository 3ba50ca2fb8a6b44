"""The shipped Envoy bootstrap and its rendering, checked by Envoy itself (``--mode validate``)."""

from __future__ import annotations

import importlib.resources
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from envoy_bootstrap import (
    PickerEndpoint,
    envoy_config,
    ext_proc_filter,
    render_envoy_config,
    routing_filters,
    template_text,
)
from lig.server_binaries import server_binary
from shared import ports

REPO = Path(__file__).resolve().parents[1]


def validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([server_binary("envoy"), "--mode", "validate", "-c", str(path),
                           "--disable-hot-restart", "--log-level", "error"],
                          capture_output=True, text=True, timeout=30)


def test_shipped_bootstrap_is_valid_and_keeps_the_contract() -> None:
    template = importlib.resources.files("envoy_bootstrap").joinpath("envoy.yaml")
    with importlib.resources.as_file(template) as path:
        result = validate(path)
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load(template_text())
    ext_proc = ext_proc_filter(config)
    # Fail closed without failing open: a client's destination header is dropped before the
    # picker is asked, so a request no picker routed has no destination (503).
    assert ext_proc["failure_mode_allow"] is True
    (first, _, routing, fallback, *_) = config["static_resources"]["listeners"][0][
        "filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    assert first["name"] == "envoy.filters.http.header_mutation"
    assert {"remove": "x-gateway-destination-endpoint"} in first["typed_config"]["mutations"][
        "request_mutations"]
    assert routing["name"] == "envoy.filters.http.ext_proc"
    assert ext_proc["allow_mode_override"] is True
    assert ext_proc["processing_mode"]["request_header_mode"] == "SEND"
    assert ext_proc["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert ext_proc["message_timeout"].endswith("s")
    # A request its picker failed to route (no destination yet) is routed again, as the first
    # filter would have: same pickers, same modes; every other request skips the fallback.
    assert fallback["name"] == "lig.routing_fallback"
    (skip,) = fallback["typed_config"]["xds_matcher"]["matcher_list"]["matchers"]
    assert skip["predicate"]["single_predicate"]["input"]["typed_config"]["header_name"] == (
        "x-gateway-destination-endpoint")
    assert skip["on_match"]["action"]["name"] == "skip"
    again = fallback["typed_config"]["extension_config"]["typed_config"]
    assert routing_filters(config) == (ext_proc, again)
    assert {key: value for key, value in again.items() if key != "stat_prefix"} == ext_proc
    gateway = config["static_resources"]["listeners"][0]
    assert gateway["per_connection_buffer_limit_bytes"] > 1 << 20


def test_rendered_bootstrap_lists_every_picker_and_validates(tmp_path: Path) -> None:
    text = render_envoy_config(
        listener_port=18080, admin_port=19901, destination_header="x-pick",
        pickers=[PickerEndpoint("127.0.0.1", 19002, 19003), ("localhost", 19102, 19103)])
    path = tmp_path / "envoy.yaml"
    path.write_text(text)
    result = validate(path)
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load(text)
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    endpoints = clusters["picker"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [(e["endpoint"]["address"]["socket_address"]["port_value"],
             e["endpoint"]["health_check_config"]["port_value"]) for e in endpoints] == [
        (19002, 19003), (19102, 19103)]
    assert clusters["model_servers"]["original_dst_lb_config"]["http_header_name"] == "x-pick"
    assert "x-pick" in text and "x-gateway-destination-endpoint" not in text


def test_defaults_are_the_shared_ports_and_render_the_template_unchanged() -> None:
    config = envoy_config(pickers=[PickerEndpoint("127.0.0.1")])
    assert config == yaml.safe_load(template_text())
    gateway = config["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert gateway["port_value"] == ports.GATEWAY
    assert config["admin"]["address"]["socket_address"]["port_value"] == ports.ENVOY_ADMIN
    picker = next(c for c in config["static_resources"]["clusters"] if c["name"] == "picker")
    (endpoint,) = picker["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"]["socket_address"]["port_value"] == ports.PICKER_GRPC
    assert endpoint["endpoint"]["health_check_config"]["port_value"] == ports.PICKER_HEALTH


def test_the_template_is_package_data_found_without_the_source_tree(tmp_path: Path) -> None:
    """Laid out as a wheel installs them (no deploy/ folder beside), the packages still render."""
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"envoy_bootstrap*"' in pyproject and '"*.yaml"' in pyproject  # in the wheel
    for package in ("envoy_bootstrap", "shared"):
        shutil.copytree(REPO / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    script = ("import envoy_bootstrap, sys; "
              "assert envoy_bootstrap.__file__.startswith(sys.argv[1]), envoy_bootstrap.__file__; "
              "print(envoy_bootstrap.render_envoy_config("
              "pickers=[envoy_bootstrap.PickerEndpoint('picker')]))")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=tmp_path,
                            env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout) == envoy_config(pickers=[PickerEndpoint("picker")])


def test_at_least_one_picker_is_required() -> None:
    with pytest.raises(ValueError):
        envoy_config(listener_port=1, admin_port=2, pickers=[])


def test_envoy_itself_puts_the_model_back_only_for_rewritten_requests() -> None:
    config = yaml.safe_load(template_text())
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    names = [f["name"] for f in manager["http_filters"]]
    # Responses pass the filters in reverse: the rewrite sits after the routing filter on the
    # way out, where no filter holds the headers while it changes chunks (setBytes also sets
    # content-length on them).
    assert names == ["envoy.filters.http.header_mutation", "lig.response_rewrite",
                     "envoy.filters.http.ext_proc", "lig.routing_fallback",
                     "envoy.filters.http.router"]
    filters = {f["name"]: f["typed_config"] for f in manager["http_filters"]}
    routing = filters["envoy.filters.http.ext_proc"]
    assert routing["metadata_options"]["receiving_namespaces"]["untyped"] == ["lig"]
    rewrite = filters["lig.response_rewrite"]
    matchers = rewrite["xds_matcher"]["matcher_list"]["matchers"]
    # The marker first: a reply to a request whose headers never parsed has no request header
    # to match on. Then: only requests the picker marked for the rewrite.
    inputs = [m["predicate"].get("single_predicate") or m["predicate"]["not_matcher"][
        "single_predicate"] for m in matchers]
    assert [i["input"]["typed_config"]["header_name"] for i in inputs] == [
        "x-gateway-local-reply", "x-gateway-model-rewrite"]
    lua = rewrite["extension_config"]["typed_config"]
    assert lua["@type"].endswith("envoy.extensions.filters.http.lua.v3.Lua")
    script = lua["default_source_code"]["inline_string"]
    assert 'dynamicMetadata():get("lig")' in script and "requested_model" in script
    mappers = manager["local_reply_config"]["mappers"]
    assert all(m["headers_to_add"][0]["header"]["key"] == "x-gateway-local-reply"
               for m in mappers)
    assert {"remove": "x-gateway-local-reply"} in filters["envoy.filters.http.header_mutation"][
        "mutations"]["response_mutations"]


def test_the_lua_script_is_rendered_as_a_readable_block() -> None:
    text = render_envoy_config(pickers=[PickerEndpoint("127.0.0.1")])
    assert "inline_string: |\n" in text
    assert "function envoy_on_response(handle)\n" in text


def test_response_timeout_is_rendered_as_the_routes_idle_limit_per_try(tmp_path: Path) -> None:
    def route(config: dict[str, object]) -> dict[str, object]:
        manager = config["static_resources"]["listeners"][0][  # type: ignore[index]
            "filter_chains"][0]["filters"][0]["typed_config"]
        return manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"]

    shipped = route(yaml.safe_load(template_text()))
    assert shipped["retry_policy"] == {"num_retries": 0, "per_try_idle_timeout": "120s"}
    text = render_envoy_config(listener_port=18080, admin_port=19901, response_timeout=2.5,
                               pickers=[PickerEndpoint("127.0.0.1", 19002, 19003)])
    assert route(yaml.safe_load(text))["retry_policy"]["per_try_idle_timeout"] == "2.5s"
    path = tmp_path / "envoy.yaml"
    path.write_text(text)
    assert validate(path).returncode == 0
    with pytest.raises(ValueError):
        envoy_config(listener_port=1, admin_port=2, pickers=[("h", 1, 2)], response_timeout=0)


@pytest.mark.parametrize("body_mode", ["BUFFERED", "STREAMED", "FULL_DUPLEX_STREAMED"])
def test_each_body_mode_renders_a_valid_bootstrap(tmp_path: Path, body_mode: str) -> None:
    config = envoy_config(listener_port=18080, admin_port=19901,
                          pickers=[PickerEndpoint("127.0.0.1")], body_mode=body_mode)
    mode = ext_proc_filter(config)["processing_mode"]
    assert mode["request_body_mode"] == body_mode
    assert [f["processing_mode"] for f in routing_filters(config)] == [mode, mode]
    names = [f["name"] for f in config["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"][0]["typed_config"]["http_filters"]]
    if body_mode == "FULL_DUPLEX_STREAMED":
        # The routing stream sees the whole response and puts the model back itself.
        assert mode["response_body_mode"] == body_mode
        assert mode["request_trailer_mode"] == mode["response_trailer_mode"] == "SEND"
    else:
        assert mode["response_body_mode"] == "NONE"
    # Envoy puts it back in every mode: a picker that dies mid-response lets the rest of a
    # FULL_DUPLEX_STREAMED response through unchanged.
    assert "lig.response_rewrite" in names
    path = tmp_path / "envoy.yaml"
    path.write_text(render_envoy_config(listener_port=18080, admin_port=19901,
                                        pickers=[PickerEndpoint("127.0.0.1")],
                                        body_mode=body_mode))
    result = validate(path)
    assert result.returncode == 0, result.stdout + result.stderr
    with pytest.raises(ValueError, match="unknown body mode"):
        envoy_config(listener_port=1, admin_port=2, pickers=[PickerEndpoint("h")],
                     body_mode="GRPC")
