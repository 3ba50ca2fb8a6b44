"""The test API server (tests/support/kube_apiserver.py) behaves as its docstring says, seen by a
plain HTTP client: lists, label selectors, namespaces, watch replay, bookmarks, 410 Gone."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.support.kube_apiserver import KubeApiServer

PODS = "/api/v1/namespaces/default/pods"


def pod(name: str, namespace: str = "default", **labels: str) -> dict[str, Any]:
    return {"kind": "Pod", "metadata": {"name": name, "namespace": namespace, "labels": labels}}


async def watch(kube: KubeApiServer, path: str, count: int, **params: str) -> list[dict]:
    """The first ``count`` events of a watch (bounded by a 5 s timeout)."""
    events: list[dict] = []
    async with (httpx.AsyncClient(base_url=kube.url, timeout=5) as client,
                client.stream("GET", path, params={"watch": "1", **params}) as response):
        assert response.status_code == 200
        assert response.headers["transfer-encoding"] == "chunked"
        async for line in response.aiter_lines():
            events.append(json.loads(line))
            if len(events) == count:
                break
    return events


async def test_list_has_a_global_resource_version_and_filters(kube: KubeApiServer) -> None:
    kube.put(pod("a", app="x"))
    kube.put(pod("b", app="y"))
    kube.put(pod("c", "other", app="x"))
    async with httpx.AsyncClient(base_url=kube.url) as client:
        listed = (await client.get(PODS, params={"labelSelector": "app=x"})).json()
        everywhere = (await client.get("/api/v1/pods", params={"labelSelector": "app"})).json()
        bad = await client.get(PODS, params={"labelSelector": "app in (x)"})
        missing = await client.get("/apis/example.com/v1/namespaces/default/things")
    assert listed["metadata"]["resourceVersion"] == "3"
    assert [i["metadata"]["name"] for i in listed["items"]] == ["a"]
    assert "kind" not in listed["items"][0]
    assert sorted(i["metadata"]["name"] for i in everywhere["items"]) == ["a", "b", "c"]
    assert bad.status_code == 400 and missing.status_code == 404


async def test_watch_replays_from_a_version_and_streams_deletes(kube: KubeApiServer) -> None:
    kube.put(pod("a"))
    version = kube.put(pod("b"))["metadata"]["resourceVersion"]
    kube.put(pod("b", tier="gold"))
    kube.delete("Pod", "a")
    events = await watch(kube, PODS, 2, resourceVersion=version)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("MODIFIED", "b"), ("DELETED", "a")]
    assert events[1]["object"]["metadata"]["resourceVersion"] == "4"
    fresh = await watch(kube, PODS, 1)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in fresh] == [("ADDED", "b")]


async def test_bookmarks_when_allowed_and_timeout_ends_the_watch(kube: KubeApiServer) -> None:
    kube.put(pod("a"))
    events = await watch(kube, PODS, 2, resourceVersion="1", allowWatchBookmarks="true")
    assert [e["type"] for e in events] == ["BOOKMARK", "BOOKMARK"]
    assert events[0]["object"]["metadata"] == {"resourceVersion": "1"}
    async with httpx.AsyncClient(base_url=kube.url, timeout=5) as client:
        ended = await client.get(PODS, params={"watch": "1", "resourceVersion": "1",
                                               "timeoutSeconds": "0.3"})
    assert ended.status_code == 200 and ended.text == ""  # no bookmarks unless allowed


@pytest.mark.parametrize("as_http", [False, True])
async def test_too_old_version_is_410_gone(kube: KubeApiServer, as_http: bool) -> None:
    kube.put(pod("a"))
    kube.put(pod("b"))
    kube.compact()
    kube.gone_as_http = as_http
    async with httpx.AsyncClient(base_url=kube.url, timeout=5) as client:
        response = await client.get(PODS, params={"watch": "1", "resourceVersion": "1"})
    if as_http:
        assert response.status_code == 410 and response.json()["code"] == 410
    else:
        event = json.loads(response.text.splitlines()[0])
        assert event["type"] == "ERROR" and event["object"]["code"] == 410
        assert event["object"]["reason"] == "Expired"


async def test_restart_keeps_objects_and_port(kube: KubeApiServer) -> None:
    kube.put(pod("a"))
    port = kube.port
    await kube.stop()
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(base_url=kube.url) as client:
            await client.get(PODS)
    await kube.start()
    assert kube.port == port
    async with httpx.AsyncClient(base_url=kube.url) as client:
        assert len((await client.get(PODS)).json()["items"]) == 1
