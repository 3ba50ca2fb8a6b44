"""A small Kubernetes API server for tests: list and watch, the way kube-apiserver serves them.

This is the one protocol fake of the suite (no kube-apiserver can be installed here). It listens on
127.0.0.1 only, speaks plain HTTP/1.1 (h11) without authentication, and keeps its objects in
memory; tests change them with :meth:`KubeApiServer.put` / :meth:`KubeApiServer.delete`.

Covered, as kube-apiserver does it:

- paths ``/api/v1/[namespaces/NS/]pods`` and ``/apis/GROUP/VERSION/[namespaces/NS/]PLURAL`` for
  the kinds in :data:`PLURALS`; ``GET`` of a collection only (no get of one object, no writes
  over HTTP, no discovery);
- ``resourceVersion``: one global counter, bumped by every create, update and delete; each
  object's ``metadata.resourceVersion`` is the version that last wrote it; a list carries the
  current version in ``metadata.resourceVersion``; list items have no ``kind``/``apiVersion``;
- ``labelSelector`` with equality terms (``k=v``, ``k==v``, ``k!=v``) and existence terms (``k``,
  ``!k``), comma-separated (AND); set-based terms (``in``, ``notin``) are a 400;
- ``?watch=1`` (or ``true``): a chunked stream of JSON lines ``{"type", "object"}``, types
  ``ADDED``, ``MODIFIED``, ``DELETED``; from ``resourceVersion`` N it replays the retained events
  newer than N first; without a version (or ``0``) it starts with a synthetic ``ADDED`` per current
  object; ``timeoutSeconds`` ends the stream cleanly; ``allowWatchBookmarks=true`` adds a
  ``BOOKMARK`` (an object with only ``kind``, ``apiVersion`` and ``metadata.resourceVersion``)
  every :attr:`bookmark_interval` seconds and on :meth:`bookmark`;
- ``410 Gone`` for a too-old ``resourceVersion``: older than the oldest retained event (see
  :meth:`compact`), answered as kube-apiserver's watch cache does, HTTP 200 then one ``ERROR``
  event whose object is a ``Status`` with ``code: 410``, ``reason: Expired``; or, after
  ``gone_as_http = True``, as an HTTP 410 with the ``Status`` as body; :meth:`expire_watches`
  sends that ERROR to every open watch (as when the watch cache falls behind);
- failures: ``answer_with[kind] = code`` answers every request for that kind with a ``Status`` of
  that code (404 as for a CRD that is not installed, 403 as RBAC would, 500...);
- dead connections: :meth:`mute_watches` keeps the open watches open but sends nothing more;
- restarts: :meth:`stop` closes the listener and every connection (the objects and the counter
  survive, as they would in etcd); :meth:`start` listens again on the same port.

Not covered: authentication and authorization (RBAC), field selectors, pagination (``limit`` and
``continue`` are ignored: one page), ``resourceVersionMatch``, ``sendInitialEvents``, server-side
apply, protobuf, HTTP/2, admission and OpenAPI validation (objects are stored as given), status
subresources, graceful deletion (a test sets ``deletionTimestamp`` itself, then deletes), and
watch-cache semantics beyond the retained-event window.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11
import pytest

# kind -> (group, version, plural); the core group is "".
PLURALS: dict[str, tuple[str, str, str]] = {
    "Pod": ("", "v1", "pods"),
    "InferencePool": ("inference.networking.k8s.io", "v1", "inferencepools"),
    "InferenceObjective": ("inference.networking.x-k8s.io", "v1alpha2", "inferenceobjectives"),
    "InferenceModelRewrite": ("inference.networking.x-k8s.io", "v1alpha2",
                              "inferencemodelrewrites"),
    "InferenceModel": ("inference.networking.x-k8s.io", "v1alpha2", "inferencemodels"),
}
_BY_PATH = {(group, version, plural): kind for kind, (group, version, plural) in PLURALS.items()}

Key = tuple[str, str, str]  # kind, namespace, name


class _Watch:
    """One open watch stream: what it selects and a queue of lines to send."""

    def __init__(self, kind: str, namespace: str | None, selector: str, bookmarks: bool) -> None:
        self.kind = kind
        self.namespace = namespace
        self.selector = selector
        self.bookmarks = bookmarks
        self.muted = False
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    def wants(self, kind: str, obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        return (kind == self.kind and self.namespace in (None, meta.get("namespace"))
                and matches(self.selector, meta.get("labels") or {}))


class KubeApiServer:
    """Serve list and watch of in-memory objects on 127.0.0.1:``port`` (0: pick a free one)."""

    def __init__(self, port: int = 0, bookmark_interval: float = 1.0) -> None:
        self.port = port
        self.bookmark_interval = bookmark_interval
        self.gone_as_http = False
        self.answer_with: dict[str, int] = {}
        self.version = 0
        self.objects: dict[Key, dict[str, Any]] = {}
        # Retained events (version, kind, type, object), oldest first; versions below
        # self._oldest are compacted away and answered with 410.
        self._events: list[tuple[int, str, str, dict[str, Any]]] = []
        self._oldest = 1
        self._watches: set[_Watch] = set()
        self._connections: dict[asyncio.StreamWriter, asyncio.Task[Any]] = {}
        self._server: asyncio.Server | None = None
        self.requests: list[str] = []
        # When each watch event was handed to the kernel (time.time(), the clock NATS stamps
        # stored messages with): where a delay promised by the registry starts.
        self.sent: list[float] = []

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Listen (again, on the same port after :meth:`stop`)."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Close the listener and every connection; the objects survive."""
        if self._server is not None:
            self._server.close()
            self._server = None
        # Abort rather than cancel the handlers (cancelling them makes asyncio log errors).
        for writer in list(self._connections):
            writer.transport.abort()
        for watch in list(self._watches):
            watch.queue.put_nowait(None)
        await asyncio.gather(*self._connections.values(), return_exceptions=True)

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig pointing at this server, with ``namespace`` as the context's namespace."""
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test",
                                                      "namespace": namespace}}],
        }
        path.write_text(json.dumps(config))
        return path

    # --- changing objects (what kubectl apply/delete would do) ---

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or update ``obj`` (with ``kind`` and ``metadata.name``); return what is kept."""
        obj = copy.deepcopy(obj)
        kind = obj["kind"]
        group, version, _ = PLURALS[kind]
        obj.setdefault("apiVersion", f"{group}/{version}" if group else version)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        key = (kind, meta["namespace"], meta["name"])
        previous = self.objects.get(key)
        self.version += 1
        meta["resourceVersion"] = str(self.version)
        meta.setdefault("uid", f"uid-{key[1]}-{key[2]}")
        meta.setdefault("creationTimestamp",
                        previous["metadata"]["creationTimestamp"] if previous else _now())
        self.objects[key] = obj
        self._emit(kind, "MODIFIED" if previous else "ADDED", obj)
        return obj

    def delete(self, kind: str, name: str, namespace: str = "default") -> None:
        """Delete an object; watchers get DELETED with the deletion's resourceVersion."""
        obj = self.objects.pop((kind, namespace, name))
        self.version += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.version)
        self._emit(kind, "DELETED", obj)

    def compact(self) -> None:
        """Forget every retained event: a watch from any older version now gets 410 Gone."""
        self._events.clear()
        self._oldest = self.version + 1

    def expire_watches(self) -> None:
        """Send 410 Gone to every open watch and end it (the client must list again)."""
        for watch in list(self._watches):
            watch.queue.put_nowait(_line({"type": "ERROR", "object": _gone_status()}))
            watch.queue.put_nowait(None)

    def close_watches(self) -> None:
        """End every open watch cleanly (as ``timeoutSeconds`` does)."""
        for watch in list(self._watches):
            watch.queue.put_nowait(None)

    def watching(self) -> set[str]:
        """The kinds with an open watch."""
        return {watch.kind for watch in self._watches}

    def mute_watches(self) -> None:
        """Make every open watch silent but open, like a connection that died without a FIN."""
        for watch in self._watches:
            watch.muted = True

    def bookmark(self) -> None:
        """Send a BOOKMARK at the current version to every watch that allows them."""
        for watch in list(self._watches):
            if watch.bookmarks:
                watch.queue.put_nowait(_line(self._bookmark(watch.kind)))

    def _emit(self, kind: str, kind_of_event: str, obj: dict[str, Any]) -> None:
        self._events.append((self.version, kind, kind_of_event, obj))
        for watch in list(self._watches):
            if watch.wants(kind, obj):
                watch.queue.put_nowait(_line({"type": kind_of_event, "object": obj}))

    def _bookmark(self, kind: str) -> dict[str, Any]:
        group, version, _ = PLURALS[kind]
        return {"type": "BOOKMARK", "object": {
            "kind": kind, "apiVersion": f"{group}/{version}" if group else version,
            "metadata": {"resourceVersion": str(self.version)}}}

    # --- HTTP ---

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[writer] = task
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(65536)
                    conn.receive_data(data)
                    if not data:
                        return
                    continue
                if isinstance(event, h11.Request):
                    await self._answer(conn, writer, event)
                elif isinstance(event, h11.ConnectionClosed):
                    return
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                    conn.start_next_cycle()
        except (h11.RemoteProtocolError, ConnectionError):
            return
        finally:
            self._connections.pop(writer, None)
            writer.close()

    async def _answer(self, conn: h11.Connection, writer: asyncio.StreamWriter,
                      request: h11.Request) -> None:
        target = request.target.decode()
        self.requests.append(target)
        split = urlsplit(target)
        query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        route = _route(split.path)
        if request.method != b"GET" or route is None:
            await _send_json(conn, writer, 404, _status(404, "NotFound", f"no route {split.path}"))
            return
        kind, namespace = route
        if kind in self.answer_with:
            code = self.answer_with[kind]
            await _send_json(conn, writer, code, _status(code, "Failure", f"{kind}: test failure"))
            return
        selector = query.get("labelSelector", "")
        try:
            matches(selector, {})
        except ValueError as exc:
            await _send_json(conn, writer, 400, _status(400, "BadRequest", str(exc)))
            return
        if query.get("watch") in ("1", "true"):
            await self._stream(conn, writer, kind, namespace, selector, query)
            return
        group, version, _ = PLURALS[kind]
        items = []
        for (k, ns, _name), obj in sorted(self.objects.items()):
            if k == kind and namespace in (None, ns) and matches(
                    selector, obj["metadata"].get("labels") or {}):
                item = copy.deepcopy(obj)
                item.pop("kind", None)
                item.pop("apiVersion", None)
                items.append(item)
        await _send_json(conn, writer, 200, {
            "kind": f"{kind}List", "apiVersion": f"{group}/{version}" if group else version,
            "metadata": {"resourceVersion": str(self.version)}, "items": items})

    async def _stream(self, conn: h11.Connection, writer: asyncio.StreamWriter, kind: str,
                      namespace: str | None, selector: str, query: dict[str, str]) -> None:
        since = int(query.get("resourceVersion") or 0)
        if since and since + 1 < self._oldest:
            if self.gone_as_http:
                await _send_json(conn, writer, 410, _gone_status())
                return
            await _start_stream(conn, writer)
            await _send_chunk(conn, writer, _line({"type": "ERROR", "object": _gone_status()}))
            await _end_stream(conn, writer)
            return
        watch = _Watch(kind, namespace, selector, query.get("allowWatchBookmarks") == "true")
        if since:
            for version, event_kind, kind_of_event, obj in self._events:
                if version > since and watch.wants(event_kind, obj):
                    watch.queue.put_nowait(_line({"type": kind_of_event, "object": obj}))
        else:
            for (k, _ns, _name), obj in sorted(self.objects.items()):
                if watch.wants(k, obj):
                    watch.queue.put_nowait(_line({"type": "ADDED", "object": obj}))
        self._watches.add(watch)
        timeout = float(query.get("timeoutSeconds") or 0) or None
        deadline = time.monotonic() + timeout if timeout else None
        try:
            await _start_stream(conn, writer)
            while True:
                wait = self.bookmark_interval if watch.bookmarks else None
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    wait = left if wait is None else min(wait, left)
                try:
                    line = await asyncio.wait_for(watch.queue.get(), wait)
                except TimeoutError:
                    if watch.bookmarks:
                        await _send_chunk(conn, writer, _line(self._bookmark(kind)))
                    continue
                if line is None:
                    break
                if not watch.muted:
                    await _send_chunk(conn, writer, line)
                    self.sent.append(time.time())
            await _end_stream(conn, writer)
        finally:
            self._watches.discard(watch)


def matches(selector: str, labels: dict[str, str]) -> bool:
    """Whether ``labels`` satisfy an equality-based label selector; ValueError if unsupported."""
    for term in _terms(selector):
        if " in " in term or " notin " in term or "(" in term:
            raise ValueError(f"set-based selector {term!r} is not supported by the test server")
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def _terms(selector: str) -> Iterator[str]:
    return (term.strip() for term in selector.split(",") if term.strip())


def _route(path: str) -> tuple[str, str | None] | None:
    """``(kind, namespace or None)`` for a collection path."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"]:
        group, rest = "", parts[1:]
    elif parts[:1] == ["apis"] and len(parts) >= 2:
        group, rest = parts[1], parts[2:]
    else:
        return None
    namespace = None
    if len(rest) == 4 and rest[1] == "namespaces":
        namespace, rest = rest[2], [rest[0], rest[3]]
    if len(rest) != 2:
        return None
    kind = _BY_PATH.get((group, rest[0], rest[1]))
    return (kind, namespace) if kind else None


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def _gone_status() -> dict[str, Any]:
    return _status(410, "Expired", "too old resource version")


def _line(event: dict[str, Any]) -> bytes:
    return json.dumps(event).encode() + b"\n"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


async def _send_json(conn: h11.Connection, writer: asyncio.StreamWriter, code: int,
                     body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    writer.write(conn.send(h11.Response(status_code=code, headers=[
        ("content-type", "application/json"), ("content-length", str(len(data)))])))
    writer.write(conn.send(h11.Data(data=data)))
    writer.write(conn.send(h11.EndOfMessage()))
    await writer.drain()


async def _start_stream(conn: h11.Connection, writer: asyncio.StreamWriter) -> None:
    writer.write(conn.send(h11.Response(status_code=200, headers=[
        ("content-type", "application/json"), ("transfer-encoding", "chunked")])))
    await writer.drain()


async def _send_chunk(conn: h11.Connection, writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(conn.send(h11.Data(data=data)))
    await writer.drain()


async def _end_stream(conn: h11.Connection, writer: asyncio.StreamWriter) -> None:
    writer.write(conn.send(h11.EndOfMessage()))
    await writer.drain()


@pytest.fixture
async def kube() -> AsyncIterator[KubeApiServer]:
    """A started :class:`KubeApiServer` (bookmarks every 0.05 s when asked for), stopped after."""
    server = KubeApiServer(bookmark_interval=0.05)
    await server.start()
    yield server
    await server.stop()
