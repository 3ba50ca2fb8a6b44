"""``--endpoints-override FILE``: one pool's endpoints come from a file instead of the inputs.

For ``lig up`` with simulated pods on ports other than those the example lists (``--free-ports``,
``--pods``): the registry reads the user's own folder, so edits there are live and problems name
the user's files and lines, while the pool's endpoint list is replaced by the pods that run. The
file is read once, at start; it holds the pool's name and its endpoints in the input format:

    pool: vllm-llama3-8b-instruct
    endpoints:
      - {name: vllm-0, address: 127.0.0.1, port: 40123}
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import yaml

from services.registry import crd
from services.registry.loader import Registry, endpoint_set, unusable_address
from shared.errors import ConfigError


class EndpointsOverride(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The endpoints that replace ``pool``'s."""

    pool: crd.Name
    endpoints: list[crd.EndpointSpec]


class OverrideError(ConfigError):
    """The override file cannot be used; the message names it and says why."""


def read_override(path: str) -> EndpointsOverride:
    """Read and check an override file; raise :class:`OverrideError` when it is unusable."""
    try:
        data = yaml.safe_load(Path(path).read_text())
        override = msgspec.convert(data, EndpointsOverride)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, msgspec.ValidationError) as exc:
        raise OverrideError(f"{path}: {exc}") from exc
    if not override.endpoints:
        raise OverrideError(f"{path}: lists no endpoints")
    for i, endpoint in enumerate(override.endpoints):
        unusable = unusable_address(endpoint.address)
        if unusable:
            raise OverrideError(f"{path}: endpoints[{i}].address: {unusable}")
    return override


def apply_override(registry: Registry, override: EndpointsOverride) -> tuple[Registry, bool]:
    """``registry`` with ``override.pool``'s endpoint set replaced; and whether the pool exists
    (when it does not, ``registry`` is returned unchanged)."""
    pool = next((p for p in registry.pools if p.name == override.pool), None)
    if pool is None:
        return registry, False
    endpoints = endpoint_set(override.pool, override.endpoints, pool.target_port)
    others = tuple(s for s in registry.endpoint_sets if s.pool != override.pool)
    return msgspec.structs.replace(registry, endpoint_sets=(endpoints, *others)), True
