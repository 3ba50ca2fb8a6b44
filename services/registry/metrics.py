"""The registry's own Prometheus metrics (``lig_registry_*``), in a Prometheus registry apart."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.registry.loader import Registry
from services.registry.publisher import Plan


class RegistryMetrics:
    """Reload outcomes, what is published, and when things last went right."""

    def __init__(self) -> None:
        self.prometheus = CollectorRegistry(auto_describe=True)
        self.reloads = Counter(
            "lig_registry_reloads", "Input reloads by outcome (ok, invalid)", ["outcome"],
            registry=self.prometheus,
        )
        self.input_valid = Gauge(
            "lig_registry_input_valid",
            "1 when the newest input was valid, 0 when it was rejected or refused",
            registry=self.prometheus,
        )
        self.last_reload = Gauge(
            "lig_registry_last_successful_reload_timestamp_seconds",
            "Unix time of the newest valid reload", registry=self.prometheus,
        )
        self.objects = Gauge(
            "lig_registry_objects", "Objects in the desired state by kind (pool, model, endpoints)",
            ["kind"], registry=self.prometheus,
        )
        self.writes = Counter(
            "lig_registry_kv_writes", "KV writes by operation (put, delete)", ["op"],
            registry=self.prometheus,
        )
        self.publishes = Counter(
            "lig_registry_publishes", "Publish passes by outcome (ok, error)", ["outcome"],
            registry=self.prometheus,
        )
        self.last_publish = Gauge(
            "lig_registry_last_successful_publish_timestamp_seconds",
            "Unix time of the newest pass that left the bucket equal to the desired state",
            registry=self.prometheus,
        )
        self.refusals = Counter(
            "lig_registry_refused",
            "Publishes refused because they would remove every pool (no_pools) or every "
            "endpoint of a pool (no_endpoints); see --allow-empty", ["reason"],
            registry=self.prometheus,
        )
        for reason in ("no_pools", "no_endpoints"):
            self.refusals.labels(reason)
        for outcome in ("ok", "invalid"):
            self.reloads.labels(outcome)
        for outcome in ("ok", "error"):
            self.publishes.labels(outcome)
        for op in ("put", "delete"):
            self.writes.labels(op)

    def reload_ok(self, desired: Registry) -> None:
        """Count a valid reload and record the size of the new desired state."""
        self.reloads.labels("ok").inc()
        self.input_valid.set(1)
        self.last_reload.set(time.time())
        self._set_objects(desired)

    def _set_objects(self, state: Registry) -> None:
        self.objects.labels("pool").set(len(state.pools))
        self.objects.labels("model").set(len(state.models))
        self.objects.labels("endpoints").set(len(state.endpoint_sets))

    def refused(self, reason: str, kept: Registry | None) -> None:
        """Count a refused publish; the objects gauges go back to the state that stays."""
        self.refusals.labels(reason).inc()
        self.input_valid.set(0)
        self._set_objects(kept or Registry())

    def reload_invalid(self) -> None:
        """Count a rejected reload (the previous state stays published)."""
        self.reloads.labels("invalid").inc()
        self.input_valid.set(0)

    def published(self, done: Plan) -> None:
        """Count a successful publish pass and its writes."""
        self.publishes.labels("ok").inc()
        self.writes.labels("put").inc(len(done.puts))
        self.writes.labels("delete").inc(len(done.deletes))
        self.last_publish.set(time.time())

    def publish_failed(self) -> None:
        """Count a publish pass that failed (it will be retried)."""
        self.publishes.labels("error").inc()
