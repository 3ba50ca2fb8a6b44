"""A picker on a real NATS does not believe a snapshot about an address the registry does not
list for that pod: it is dropped, counted, and the pod stays without fresh metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from tests.support.fleet_feed import FleetFeed
from tests.support.nats_server import NatsServer
from tests.support.picker import PickerProcess
from tests.support.waiting import eventually

POOL = "pool-a"


def samples(picker: PickerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the picker's /metrics by (name, labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(picker.metrics())
            for s in family.samples}


async def test_snapshots_for_unregistered_addresses_are_dropped_and_counted(
    nats_server: NatsServer, picker_process: Callable[..., PickerProcess],
) -> None:
    feed = FleetFeed(nats_server.url, POOL, interval=0.05).start()
    try:
        feed.set_pool()
        feed.set_endpoints({"pod-0": "127.0.0.1:9", "pod-1": "127.0.0.1:10"})
        feed.set_metrics("pod-0", "127.0.0.1:9", waiting=0)
        # Snapshots that name pod-1 but describe another machine (forged, or a stale collector).
        feed.set_metrics("pod-1", "10.6.6.6:10", waiting=0)
        picker = picker_process(POOL, nats_server.url)
        await asyncio.to_thread(picker.wait_ready)

        def counted() -> bool:
            values = samples(picker)
            return values.get(("lig_picker_wrong_address_snapshots_total", ()), 0) >= 5

        await eventually(counted, within=5, what="wrong-address snapshots counted")
        values = samples(picker)
        assert values[("lig_picker_pods", (("state", "fresh"),))] == 1
        assert values[("lig_picker_pods", (("state", "stale"),))] == 1
        # Every snapshot received is counted, dropped or not (the ingest rate).
        assert values[("lig_picker_snapshots_received_total", ())] >= \
            values[("lig_picker_wrong_address_snapshots_total", ())] + 1
        assert "registered at another address" in picker.log()
    finally:
        feed.stop()
