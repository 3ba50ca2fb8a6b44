"""The Kubernetes source of the registry: list+watch of the objects in :mod:`.kube_objects`.

One loop per kind lists the kind (every object of the namespace; pods are filtered by the pools'
selectors here, so a selector edit needs no new watch), replaces that kind's objects in the
:class:`~services.registry.kube_objects.KubeState` in one step (so a relist never shows a gap),
then watches from the list's resourceVersion. lightkube resumes a watch that simply ended from the
newest version it saw; a ``410 Gone`` (an ERROR event or an HTTP 410), any other error or an
unreachable API server ends the watch, and the loop lists again after a backoff (0.2 s doubling to
5 s; at once after a 410, or after a watch silent for ``IDLE_SECONDS``). Meanwhile the state, and
so the published registry, stays as it was.

The client is lightkube's ``AsyncClient`` (httpx-based, async list and watch, generic resources
for CRDs); configuration is ``--kubeconfig PATH`` or else the pod's service account.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from lightkube import AsyncClient, KubeConfig
from lightkube.core.exceptions import ApiError
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Pod

from services.registry import kube_objects
from services.registry.kube_objects import KubeState
from shared.logs import RateLimitedLog

log = logging.getLogger("lig.registry.kubernetes")

POOL_GROUP = "inference.networking.k8s.io"
X_GROUP = "inference.networking.x-k8s.io"
RESOURCES: dict[str, Any] = {
    kube_objects.POOL: create_namespaced_resource(POOL_GROUP, "v1", "InferencePool",
                                                  "inferencepools"),
    kube_objects.POD: Pod,
    kube_objects.OBJECTIVE: create_namespaced_resource(X_GROUP, "v1alpha2", "InferenceObjective",
                                                       "inferenceobjectives"),
    kube_objects.REWRITE: create_namespaced_resource(X_GROUP, "v1alpha2", "InferenceModelRewrite",
                                                     "inferencemodelrewrites"),
    kube_objects.MODEL: create_namespaced_resource(X_GROUP, "v1alpha2", "InferenceModel",
                                                   "inferencemodels"),
}
BACKOFF_MIN = 0.2
BACKOFF_MAX = 5.0
# The API server is asked to end each watch after WATCH_SECONDS (lightkube then resumes it); a
# watch with no event for IDLE_SECONDS is dropped and the kind listed again, so that a connection
# that died without a FIN cannot leave the source silently stale.
WATCH_SECONDS = 240
IDLE_SECONDS = 300.0
# A kind the API server does not serve (its CRD is not installed) is looked for again this often.
NOT_SERVED_RETRY = 60.0


def make_client(kubeconfig: str | None, namespace: str | None) -> AsyncClient:
    """A client from ``kubeconfig`` (a path) or else the in-cluster service account."""
    config = (KubeConfig.from_file(kubeconfig) if kubeconfig
              else KubeConfig.from_service_account())
    return AsyncClient(config, namespace=namespace)


class KubeSource:
    """Keeps a :class:`KubeState` equal to the API server's objects; calls ``on_change`` after
    every change, and reports when every kind has been listed once (``synced``)."""

    def __init__(
        self, client: AsyncClient, state: KubeState, on_change: Callable[[], None]
    ) -> None:
        self.state = state
        self._client = client
        self._on_change = on_change
        self._listed: set[str] = set()
        self.synced = asyncio.Event()

    @property
    def namespace(self) -> str:
        """The namespace watched."""
        return str(self._client.namespace)

    async def run(self) -> None:
        """List and watch every kind until cancelled."""
        async with asyncio.TaskGroup() as group:
            for kind in kube_objects.KINDS:
                group.create_task(self._follow(kind))

    async def _follow(self, kind: str) -> None:
        resource = RESOURCES[kind]
        errors = RateLimitedLog(log)
        delay = 0.0
        while True:
            if delay:
                await asyncio.sleep(delay)
            try:
                version = await self._list(kind, resource)
                delay = 0.0
                await self._watch(kind, resource, version)
            except Exception as exc:  # unreachable, an error answer or a broken stream: list again
                code = _status_code(exc)
                if code == 410:
                    log.info("%s: watch expired (410 Gone); listing again", kind)
                    delay = 0.0
                    continue
                if code == 404:
                    # The kind's CRD is not installed: nothing of that kind exists (yet).
                    if kind not in self._listed:
                        log.warning("%s: not served by the API server (CRD not installed?); "
                                    "treated as empty, looking again every %.0f s", kind,
                                    NOT_SERVED_RETRY)
                        self._mark_listed(kind)
                    delay = NOT_SERVED_RETRY
                    continue
                delay = min(max(BACKOFF_MIN, delay * 2), BACKOFF_MAX)
                errors.warning("%s: list/watch failed (%s: %s); keeping the last state, "
                               "retrying in %.1f s", kind, type(exc).__name__, exc, delay)

    async def _watch(self, kind: str, resource: Any, version: str) -> None:
        """Apply the events of one watch; return when it stayed silent for ``IDLE_SECONDS``."""
        loop = asyncio.get_running_loop()
        idle = asyncio.timeout_at(loop.time() + IDLE_SECONDS)
        try:
            async with idle:
                async for event, obj in self._client.watch(resource, resource_version=version,
                                                           server_timeout=WATCH_SECONDS):
                    idle.reschedule(loop.time() + IDLE_SECONDS)
                    self._event(kind, event, obj)
        except TimeoutError:
            if not idle.expired():
                raise
            log.debug("%s: no event for %.0f s; listing again", kind, IDLE_SECONDS)

    async def _list(self, kind: str, resource: Any) -> str:
        listing = self._client.list(resource)
        objects = [obj.to_dict() async for obj in listing]
        before = self.state.generation
        self.state.replace(kind, objects)
        self._mark_listed(kind)
        log.info("%s: listed %d objects at resourceVersion %s", kind, len(objects),
                 listing.resourceVersion)
        if self.state.generation != before:
            self._on_change()
        return listing.resourceVersion

    def _mark_listed(self, kind: str) -> None:
        self._listed.add(kind)
        if len(self._listed) == len(kube_objects.KINDS) and not self.synced.is_set():
            self.synced.set()
            self._on_change()

    def _event(self, kind: str, event: str, obj: Any) -> None:
        if event not in ("ADDED", "MODIFIED", "DELETED"):
            return  # BOOKMARK: lightkube has already taken its resourceVersion
        before = self.state.generation
        data = obj.to_dict()
        if event == "DELETED":
            self.state.delete(kind, data)
        else:
            self.state.apply(kind, data)
        if self.state.generation != before:
            self._on_change()


def _status_code(exc: Exception) -> int | None:
    """The HTTP status of an API error: a Status object (ApiError, e.g. a watch's ERROR event)
    or an error response to the watch request itself (lightkube raises httpx's error then)."""
    if isinstance(exc, ApiError):
        return exc.status.code
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)
