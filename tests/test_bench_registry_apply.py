"""bench/bench_registry_apply.py still runs against the picker's wiring: a small burst through
both of its consumers (a bench that no longer matches the code it measures fails here, not on
the next person who runs it)."""

from __future__ import annotations

import asyncio

from bench.bench_registry_apply import incremental, one_round, rebuild_per_entry
from tests.support.nats_server import NatsServer

MODELS = 30


async def test_a_small_burst_reaches_the_router_through_both_consumers(
        nats_server: NatsServer) -> None:
    for consumer in (incremental, rebuild_per_entry):
        result = await asyncio.wait_for(one_round(nats_server.url, MODELS, consumer), 60)
        assert result.updates >= 1, consumer.__name__
        assert 0 < result.wall < 60 and result.cpu > 0, (consumer.__name__, result)
