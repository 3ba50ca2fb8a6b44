"""The registry's control loop for the Kubernetes source.

It is the file source's :class:`~services.registry.reconciler.Reconciler` (same publisher, retry
backoff, resync and metrics) with another input: instead of reading files, ``check_inputs`` builds
the desired registry from the watched objects whenever they changed. Nothing is published before
every kind has been listed once, so a starting registry never deletes what its peers published.
Emptiness is not refused (``allow_empty``): a pool whose pods are all unready or scaled to zero
has no endpoints, and the API server says so; an unreachable one changes nothing.
"""

from __future__ import annotations

import logging

from services.registry.kube_objects import KubeState
from services.registry.metrics import RegistryMetrics
from services.registry.reconciler import Reconciler

log = logging.getLogger("lig.registry")


class KubeReconciler(Reconciler):
    """Publishes :class:`KubeState` (wake it with :meth:`request_reload` after a change)."""

    def __init__(self, state: KubeState, metrics: RegistryMetrics, *,
                 resync_interval: float = 30.0) -> None:
        super().__init__((), metrics, watch_interval=0, resync_interval=resync_interval,
                         allow_empty=True)
        self.state = state
        self.synced = False
        self._built = -1

    async def check_inputs(self) -> None:
        """Rebuild the desired state if the watched objects changed (or a reload was forced)."""
        forced, self._force_reload = self._force_reload, False
        if not self.synced or (self.state.generation == self._built and not forced):
            return
        self._built = self.state.generation
        desired = self.state.registry()
        self._metrics.reload_ok(desired)
        if self.state.rejected:
            # lig_registry_input_valid 0 while any object's newest version is rejected.
            self._metrics.reload_invalid()
        if forced or desired != self.desired:
            log.info("desired state: %d pools, %d models, %d endpoints",
                     len(desired.pools), len(desired.models),
                     sum(len(e.endpoints) for e in desired.endpoint_sets))
            self.desired = desired
            self.request_resync()
