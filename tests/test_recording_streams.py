"""The collector's recording streams on a real nats-server with JetStream and a store dir:
snapshots, decisions and registry changes are recorded with age and size limits, recording
can be turned off, and it survives a NATS restart (with its store, and with the store lost)."""

from __future__ import annotations

import asyncio
import shutil
import time

import nats
import pytest
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from services.collector.recording import StreamBytes, ensure_recording, registry_source
from shared.nats_connection import NatsSettings, connect
from shared.schemas import InferencePool
from tests.support.collector import (
    SUBJECTS,
    pod,
    put_pool,
    registry_bucket,
    running_collector,
    settings,
)
from tests.support.metrics_pages import fixture_page
from tests.support.nats_server import NatsServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(90)

V1 = fixture_page("vllm_v1.txt")
SMALL = StreamBytes(metrics=1 << 20, decisions=512 << 10, registry=256 << 10)
STREAMS = (SUBJECTS.metrics_stream, SUBJECTS.decisions_stream, SUBJECTS.registry_stream)


class Counts:
    """Messages stored in each recording stream, read on demand (-1 while a stream is absent)."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.now: dict[str, int] = {}

    async def read(self) -> dict[str, int]:
        js = self.nc.jetstream(timeout=2)
        for stream in STREAMS:
            try:
                self.now[stream] = (await js.stream_info(stream)).state.messages
            except (nats.errors.Error, TimeoutError):
                self.now[stream] = -1
        return self.now

    async def until(self, within: float, what: str, **at_least: int) -> None:
        """Wait until each named stream ('metrics', 'decisions', 'registry') exists and holds
        at least the given number of messages."""
        wanted = {f"LIG_{name.upper()}": count for name, count in at_least.items()}
        for _ in range(int(within / 0.2)):
            now = await self.read()
            if all(now[stream] >= count for stream, count in wanted.items()):
                return
            await asyncio.sleep(0.2)
        raise AssertionError(f"{what}: wanted {wanted}, have {self.now}")


async def test_every_recording_stream_has_an_age_and_a_size_limit(nats_server: NatsServer
                                                                   ) -> None:
    nc = await connect(NatsSettings(url=nats_server.url), "test")
    js = nc.jetstream()
    try:
        # An existing snapshot recording from before the size limit gets one.
        await js.add_stream(name=SUBJECTS.metrics_stream, subjects=[SUBJECTS.all_metrics()],
                            max_age=3600)
        # An existing decision recording from before the decision records gets their subject.
        await js.add_stream(name=SUBJECTS.decisions_stream, subjects=[SUBJECTS.all_decisions()],
                            max_age=600.0, max_bytes=SMALL.decisions)
        done = await ensure_recording(js, SUBJECTS, 600.0, max_bytes=SMALL)
        assert done == {SUBJECTS.metrics_stream: "updated", SUBJECTS.decisions_stream: "updated",
                        SUBJECTS.registry_stream: "created"}
        limits = {}
        for stream in STREAMS:
            config = (await js.stream_info(stream)).config
            limits[stream] = (config.max_age, config.max_bytes, config.subjects,
                              [source.name for source in config.sources or ()])
        assert limits == {
            SUBJECTS.metrics_stream: (600.0, SMALL.metrics, ["lig.metrics.>"], []),
            SUBJECTS.decisions_stream: (600.0, SMALL.decisions,
                                        [SUBJECTS.all_decisions(), SUBJECTS.all_records()], []),
            SUBJECTS.registry_stream: (600.0, SMALL.registry, None,
                                       [registry_source(SUBJECTS)]),
        }
        assert set((await ensure_recording(js, SUBJECTS, 600.0, max_bytes=SMALL)).values()) \
            == {"unchanged"}

        # The size limit holds: 2 MB of snapshots into a 1 MB stream keep under 1 MB.
        payload = b"x" * 4096
        for i in range(500):
            await nc.publish(SUBJECTS.metrics("p", f"pod-{i % 5}"), payload)
        deadline = time.monotonic() + 10  # every one stored (the oldest discarded)
        while (await js.stream_info(SUBJECTS.metrics_stream)).state.last_seq < 500:
            assert time.monotonic() < deadline, "the 500 snapshots were not stored in 10 s"
            await asyncio.sleep(0.02)
        state = (await js.stream_info(SUBJECTS.metrics_stream)).state
        assert 0 < state.bytes <= SMALL.metrics and state.messages < 500, state
    finally:
        await nc.close()


async def test_recording_survives_a_nats_restart_with_or_without_its_store(
        nats_server: NatsServer, page_servers) -> None:  # type: ignore[no-untyped-def]
    server = page_servers.start(V1)
    nc = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    counts = Counts(nc)
    try:
        kv = await registry_bucket(nc)
        await put_pool(kv, InferencePool(name="main", target_port=8000), [pod("a", server.port)])
        async with running_collector(settings(
                nats_server.url, record_max_age_s=600.0, record_max_bytes=SMALL.metrics,
                record_decisions_max_bytes=SMALL.decisions)):
            await counts.until(15, "recording", metrics=3, registry=2)
            await nc.publish(SUBJECTS.decisions("main"), b"decision 1")
            await nc.publish(SUBJECTS.records("main"), b"record 1")
            await counts.until(5, "a decision and a record recorded", decisions=2)
            before = dict(counts.now)

            nats_server.restart()  # same store dir
            await counts.until(15, "kept over the restart", **{
                stream.removeprefix("LIG_").lower(): count for stream, count in before.items()})
            # Recording goes on: new snapshots, a decision and a registry change after it.
            await nc.publish(SUBJECTS.decisions("main"), b"decision 2")
            kv = await nc.jetstream().key_value(SUBJECTS.registry_bucket)
            await put_pool(kv, InferencePool(name="main", target_port=8001),
                           [pod("a", server.port)])
            await counts.until(15, "recorded after the restart",
                               metrics=before[SUBJECTS.metrics_stream] + 3,
                               decisions=before[SUBJECTS.decisions_stream] + 1,
                               registry=before[SUBJECTS.registry_stream] + 2)

            # A server that lost its store: the collector creates the streams again.
            nats_server.stop()
            shutil.rmtree(nats_server.store_dir)
            nats_server.start()
            await counts.until(15, "recreated after the store was lost", metrics=3)
            await counts.until(5, "every stream recreated", decisions=0, registry=0)
            await nc.publish(SUBJECTS.decisions("main"), b"decision 3")
            kv = await registry_bucket(nc)
            await put_pool(kv, InferencePool(name="main", target_port=8000),
                           [pod("a", server.port)])
            await counts.until(15, "recording every stream again", metrics=3, decisions=1,
                               registry=2)
    finally:
        await nc.close()


async def test_recording_can_be_turned_off(nats_server: NatsServer, page_servers  # type: ignore[no-untyped-def]
                                           ) -> None:
    server = page_servers.start(V1)
    nc = await nats.connect(nats_server.url)
    try:
        kv = await registry_bucket(nc)
        await put_pool(kv, InferencePool(name="main", target_port=8000), [pod("a", server.port)])
        received: list[bytes] = []

        async def keep(message) -> None:  # type: ignore[no-untyped-def]
            received.append(message.data)

        await nc.subscribe(SUBJECTS.all_metrics(), cb=keep)
        async with running_collector(settings(nats_server.url, record_max_age_s=0.0)):
            await eventually(lambda: len(received) >= 3, within=10, what="snapshots published")
        for stream in STREAMS:
            with pytest.raises(NotFoundError):
                await nc.jetstream().stream_info(stream)
    finally:
        await nc.close()
