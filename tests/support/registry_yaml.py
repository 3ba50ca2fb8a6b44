"""Registry input documents for tests, as YAML text built from small dicts."""

from __future__ import annotations

from typing import Any

import yaml

API_VERSION = "inference.networking.x-k8s.io/v1alpha2"


def pool(name: str = "pool-a", endpoints: int = 2, **spec: Any) -> dict[str, Any]:
    """An InferencePool with ``endpoints`` explicit endpoints on 10.0.0.x:8000."""
    body: dict[str, Any] = {
        "selector": {"app": name},
        "targetPortNumber": 8000,
        "endpoints": [{"name": f"pod-{i}", "address": f"10.0.0.{i + 1}"} for i in range(endpoints)],
    }
    body.update(spec)
    return {"apiVersion": API_VERSION, "kind": "InferencePool", "metadata": {"name": name},
            "spec": body}


def model(name: str = "model-a", pool_name: str = "pool-a", **spec: Any) -> dict[str, Any]:
    """An InferenceModel named ``name`` (also its modelName unless given) in ``pool_name``."""
    body: dict[str, Any] = {"modelName": name, "poolRef": {"name": pool_name}}
    body.update(spec)
    return {"apiVersion": API_VERSION, "kind": "InferenceModel", "metadata": {"name": name},
            "spec": body}


def dump(*documents: dict[str, Any]) -> str:
    """Multi-document YAML text."""
    return yaml.safe_dump_all(documents, sort_keys=False)
