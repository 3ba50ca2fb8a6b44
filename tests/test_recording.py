"""The recording streams every service keeps (``shared.recording``), on a real nats-server: the
kv-events stream's age and size limits, the collector's age limit leaving its size alone, a
limit shortened below the stream's duplicate window."""

from __future__ import annotations

import asyncio

from services.collector.recording import stream_config as snapshots_config
from services.kvevents.recording import stream_config as blocks_config
from shared.nats_connection import NatsSettings, connect
from shared.recording import ensure_stream, keep_stream, recording_config
from shared.subjects import Subjects

SUBJECTS = Subjects("lig")


async def test_a_recording_stream_is_created_then_aligned_with_its_limits(nats_server) -> None:
    nc = await connect(NatsSettings(url=nats_server.url), "test")
    js = nc.jetstream()
    try:
        assert await ensure_stream(js, blocks_config(SUBJECTS, 60.0, 1 << 20)) == "created"
        assert await ensure_stream(js, blocks_config(SUBJECTS, 60.0, 1 << 20)) == "unchanged"
        assert await ensure_stream(js, blocks_config(SUBJECTS, 60.0, 1 << 21)) == "updated"
        assert await ensure_stream(js, blocks_config(SUBJECTS, 30.0, 1 << 21)) == "updated"
        info = await js.stream_info(SUBJECTS.kv_blocks_stream)
        assert (info.config.subjects, info.config.max_age, info.config.max_bytes) == (
            [SUBJECTS.all_kv_blocks()], 30.0, 1 << 21)

        # The snapshots' stream has no size flag: a size set by an operator stays.
        await js.add_stream(name=SUBJECTS.metrics_stream, subjects=[SUBJECTS.all_metrics()],
                            max_age=60.0, max_bytes=1 << 22)
        assert await ensure_stream(js, snapshots_config(SUBJECTS, 60.0)) == "unchanged"
        assert await ensure_stream(js, snapshots_config(SUBJECTS, 90.0)) == "updated"
        info = await js.stream_info(SUBJECTS.metrics_stream)
        assert (info.config.max_age, info.config.max_bytes) == (90.0, 1 << 22)
        # Below the duplicate window the server set at creation (min(2 min, max age)).
        assert await ensure_stream(js, snapshots_config(SUBJECTS, 10.0)) == "updated"
        info = await js.stream_info(SUBJECTS.metrics_stream)
        assert (info.config.max_age, info.config.duplicate_window) == (10.0, 10.0)
    finally:
        await nc.close()


async def test_keep_stream_retries_until_stopped(nats_server) -> None:
    nc = await connect(NatsSettings(url=nats_server.url), "test")
    try:
        # JetStream refuses a stream whose subjects overlap another's: it cannot be made.
        js = nc.jetstream()
        await js.add_stream(name="OTHER", subjects=[SUBJECTS.all_kv_blocks()])
        stop = asyncio.Event()
        wanted = recording_config("LIG_COPY", SUBJECTS.all_kv_blocks(), "a copy", 60.0)
        keeping = asyncio.create_task(keep_stream(js, wanted, stop, retry_s=0.05))
        await asyncio.sleep(0.3)
        assert not keeping.done()
        stop.set()
        await asyncio.wait_for(keeping, 2.0)
        assert await js.streams_info() and "LIG_COPY" not in [
            info.config.name for info in await js.streams_info()]
    finally:
        await nc.close()
