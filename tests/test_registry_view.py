"""The registry view other services keep: pure apply logic, and the watcher on a real NATS."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest

from shared.nats_connection import NatsSettings, connect
from shared.registry_view import RegistryChanges, RegistryView, RegistryWatcher
from shared.schemas import (
    DecodeError,
    Endpoint,
    EndpointSet,
    InferenceModel,
    InferencePool,
    encode,
)
from shared.subjects import Subjects, endpoints_key, model_key, pool_key
from tests.support.waiting import eventually

POOL = InferencePool(name="pool.a", target_port=8000)
MODEL = InferenceModel(model_name="llama/3.1", pool="pool.a")
ENDPOINTS = EndpointSet(pool="pool.a", endpoints=(Endpoint("pod-0", "127.0.0.1", 8000),))


def test_apply_sets_and_deletes_by_key() -> None:
    view = RegistryView()
    view.apply(pool_key("pool.a"), encode(POOL))
    view.apply(model_key("pool.a", "llama/3.1"), encode(MODEL))
    view.apply(endpoints_key("pool.a"), encode(ENDPOINTS))
    assert view.pools == {"pool.a": POOL}
    assert view.models == {"pool.a": {"llama/3.1": MODEL}}
    assert view.endpoints["pool.a"] == ENDPOINTS
    view.apply(model_key("pool.a", "llama/3.1"), None)
    assert view.models == {"pool.a": {}}


@pytest.mark.parametrize(
    "key, value",
    [("pool.x", b"\x00garbage"), ("weird.x", encode(POOL)), ("model.onlypool", encode(MODEL)),
     (pool_key("x"), encode(MODEL))],
)
def test_apply_rejects_bad_entries(key: str, value: bytes) -> None:
    view = RegistryView()
    with pytest.raises(DecodeError):
        view.apply(key, value)
    assert not view.pools


async def test_watcher_follows_bucket_and_resyncs_after_nats_restart(nats_server) -> None:
    subjects = Subjects()
    watcher: RegistryWatcher | None = None

    async def on_reconnect() -> None:
        assert watcher is not None
        watcher.resync()

    client = await connect(NatsSettings(url=nats_server.url), "test", on_reconnect=on_reconnect)
    js = client.jetstream()
    undecodable: list[str] = []
    watcher = RegistryWatcher(js, subjects.registry_bucket, RegistryView(),
                              on_undecodable=lambda key, exc: undecodable.append(key),
                              retry_interval=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    try:
        await asyncio.sleep(0.2)  # the watcher waits for the bucket to exist
        kv = await js.create_key_value(bucket=subjects.registry_bucket, history=5)
        await kv.put(pool_key("pool.a"), encode(POOL))
        await kv.put(model_key("pool.a", "llama/3.1"), b"not msgpack")
        await asyncio.wait_for(watcher.synced.wait(), 5)
        await eventually(lambda: "pool.a" in watcher.view.pools)
        await kv.put(endpoints_key("pool.a"), encode(ENDPOINTS))
        await eventually(lambda: "pool.a" in watcher.view.endpoints)
        assert undecodable == [model_key("pool.a", "llama/3.1")]

        nats_server.restart()
        await eventually(lambda: client.is_connected, within=10)
        for _ in range(50):  # JetStream needs a moment after a restart to recover its streams
            try:
                kv = await js.key_value(subjects.registry_bucket)
                await kv.delete(endpoints_key("pool.a"))
                break
            except nats.errors.Error:
                await asyncio.sleep(0.1)
        await kv.put(model_key("pool.a", "llama/3.1"), encode(MODEL))
        await eventually(lambda: "pool.a" not in watcher.view.endpoints
                     and "llama/3.1" in watcher.view.models.get("pool.a", {}), within=5)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await client.close()


async def test_first_sync_holds_every_existing_key(nats_server) -> None:
    subjects = Subjects()
    client = await connect(NatsSettings(url=nats_server.url), "test")
    js = client.jetstream()
    kv = await js.create_key_value(bucket=subjects.registry_bucket, history=5)
    for i in range(300):
        await kv.put(pool_key(f"pool-{i}"), encode(InferencePool(name=f"pool-{i}", target_port=1)))
    await kv.delete(pool_key("pool-7"))
    sizes_at_change: list[int] = []
    watcher = RegistryWatcher(js, subjects.registry_bucket, RegistryView(),
                              on_change=lambda: sizes_at_change.append(len(watcher.view.pools)))
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    try:
        await asyncio.wait_for(watcher.synced.wait(), 5)
        assert sizes_at_change[0] == 299
        assert "pool-7" not in watcher.view.pools
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await client.close()


def test_apply_notes_the_names_it_changed() -> None:
    view = RegistryView()
    changes = RegistryChanges()
    assert not changes
    view.apply(pool_key("pool.a"), encode(POOL), changes)
    view.apply(model_key("pool.a", "llama/3.1"), encode(MODEL), changes)
    view.apply(model_key("pool.a", "gone"), None, changes)
    view.apply(endpoints_key("pool.b"), None, changes)
    with pytest.raises(DecodeError):
        view.apply(model_key("pool.c", "bad"), b"\x00garbage", changes)
    assert changes == RegistryChanges(pools={"pool.a"}, models={"pool.a": {"llama/3.1", "gone"}},
                                      endpoints={"pool.b"})
    assert changes


async def test_a_burst_reaches_subscribers_as_one_change_and_a_failing_one_is_logged(
        nats_server, caplog) -> None:  # type: ignore[no-untyped-def]
    subjects = Subjects()
    client = await connect(NatsSettings(url=nats_server.url), "test")
    js = client.jetstream()
    kv = await js.create_key_value(bucket=subjects.registry_bucket, history=1)
    seen: list[RegistryChanges] = []
    calls: list[int] = []

    def on_changes(changes: RegistryChanges) -> None:
        seen.append(changes)
        if len(seen) == 2:
            raise RuntimeError("subscriber bug")

    watcher = RegistryWatcher(js, subjects.registry_bucket, RegistryView(),
                              on_change=lambda: calls.append(len(seen)), on_changes=on_changes)
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    try:
        await asyncio.wait_for(watcher.synced.wait(), 5)
        assert seen == [RegistryChanges(everything=True)]
        names = [f"m{index}" for index in range(300)]
        await asyncio.gather(*(kv.put(model_key("pool.a", name), encode(
            InferenceModel(model_name=name, pool="pool.a"))) for name in names))
        await eventually(lambda: len(watcher.view.models.get("pool.a", {})) == 300)
        await eventually(lambda: sum(len(c.models.get("pool.a", ())) for c in seen[1:]) == 300)
        assert len(seen) < 100  # bursts, not one call per entry
        assert "subscriber bug" in caplog.text  # logged, and the watch went on
        await kv.put(pool_key("pool.a"), encode(POOL))
        await eventually(lambda: seen[-1] == RegistryChanges(pools={"pool.a"}))
        assert calls[-1] == len(seen)  # on_change follows on_changes
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await client.close()
