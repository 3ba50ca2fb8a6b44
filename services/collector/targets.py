"""What to scrape: one target per endpoint of every pool in the registry view."""

from __future__ import annotations

import msgspec

from shared.registry_view import RegistryView
from shared.schemas import Endpoint, InferencePool
from shared.subjects import Subjects, escape_token


class ScrapeTarget(msgspec.Struct, frozen=True):
    """One pod's metrics endpoint and where its snapshots go."""

    pool: str
    pod: str
    address: str  # ip:port the pod serves on (what pickers route to)
    url: str  # its metrics page
    subject: str  # where its snapshots are published

    @property
    def key(self) -> str:
        """The pod's identity for ownership hashing: unique and stable across collectors."""
        return pod_key(self.pool, self.pod)


def pod_key(pool: str, pod: str) -> str:
    """``<pool>.<pod>`` with both tokens escaped, so that no two pods share a key."""
    return f"{escape_token(pool)}.{escape_token(pod)}"


def metrics_url(endpoint: Endpoint, pool: InferencePool | None) -> str:
    """The metrics URL of ``endpoint``: the pool's metrics port and path, else its own port."""
    path = pool.metrics_path if pool is not None else "/metrics"
    port = pool.metrics_port if pool is not None and pool.metrics_port else endpoint.port
    host = f"[{endpoint.address}]" if ":" in endpoint.address else endpoint.address
    return f"http://{host}:{port}/{path.lstrip('/')}"


def targets_from_view(view: RegistryView, subjects: Subjects) -> dict[str, ScrapeTarget]:
    """Every endpoint of every pool, by :func:`pod_key`."""
    targets: dict[str, ScrapeTarget] = {}
    for pool_name, endpoint_set in view.endpoints.items():
        pool = view.pools.get(pool_name)
        for endpoint in endpoint_set.endpoints:
            target = ScrapeTarget(
                pool=pool_name,
                pod=endpoint.name,
                address=endpoint.hostport,
                url=metrics_url(endpoint, pool),
                subject=subjects.metrics(pool_name, endpoint.name),
            )
            targets[target.key] = target
    return targets
