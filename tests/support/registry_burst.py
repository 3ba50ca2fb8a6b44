"""A registry burst reaching a picker (tests/test_picker_registry_burst.py, the end-to-end test
and bench/bench_registry_apply.py): publishing thousands of models, and measuring the router's
update cost and the event loop's longest stall."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from nats.js.kv import KeyValue

from services.picker.routing import Router
from shared.nats_connection import NatsSettings, connect
from shared.registry_view import RegistryChanges, RegistryView
from shared.schemas import InferenceModel, TargetModel, encode
from shared.subjects import Subjects, model_key


class TimedRouter(Router):
    """The picker's router, counting the CPU time and the number of its registry updates."""

    busy = 0.0
    updates = 0

    def update(self, view: RegistryView, changes: RegistryChanges | None = None) -> None:
        """:meth:`Router.update`, timed and counted."""
        start = time.process_time()
        super().update(view, changes)
        self.busy += time.process_time() - start
        self.updates += 1


class LoopStall:
    """While entered: the most CPU time the event loop's thread spent before coming back to a
    task sleeping 2 ms, i.e. how long the loop was busy elsewhere (CPU, not wall time, so that
    other processes on a shared machine do not count)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            before = time.thread_time()
            await asyncio.sleep(0.002)
            self.worst = max(self.worst, time.thread_time() - before)

    def __enter__(self) -> LoopStall:
        self._task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()


PUTS_IN_FLIGHT = 200  # puts awaiting their acknowledgement at once


def burst_model(pool: str, index: int) -> InferenceModel:
    """Model ``m<index>`` of ``pool``, resolved to the target model ``m<index>-target``."""
    return InferenceModel(model_name=f"m{index}", pool=pool,
                          target_models=(TargetModel(f"m{index}-target", 1),))


async def put_models(kv: KeyValue, pool: str, count: int) -> None:
    """Put models ``m0`` to ``m<count - 1>`` into the registry bucket ``kv``, pipelined."""
    for first in range(0, count, PUTS_IN_FLIGHT):
        await asyncio.gather(*(
            kv.put(model_key(pool, f"m{index}"), encode(burst_model(pool, index)))
            for index in range(first, min(first + PUTS_IN_FLIGHT, count))))


async def publish_models(nats_url: str, pool: str, count: int,
                         on_connected: Callable[[], None] = lambda: None) -> None:
    """Connect to ``nats_url`` and :func:`put_models` into the registry bucket there."""
    client = await connect(NatsSettings(url=nats_url), "registry-burst")
    try:
        kv = await client.jetstream().key_value(Subjects().registry_bucket)
        on_connected()
        await put_models(kv, pool, count)
    finally:
        await client.close()
