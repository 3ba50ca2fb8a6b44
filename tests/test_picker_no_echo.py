"""The picker's NATS link does not receive its own decision batches back (``no_echo``): they
would only be decoded and dropped, on the request path's event loop. Real nats-server."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable

from nats.aio.client import Client
from prometheus_client import CollectorRegistry

from services.picker.app import _NatsLink, build_gateway, decision_publisher
from services.picker.main import configure, settings_from
from services.picker.observability import PickerMetrics
from shared.nats_connection import NatsSettings
from shared.registry_view import RegistryView
from shared.schemas import Criticality, DecisionBatch, RoutedEvent, decode, encode
from shared.subjects import Subjects

POOL = "pool-1"


async def test_the_picker_link_applies_peer_batches_but_never_sees_its_own(
        nats_server, nc: Client) -> None:
    parser = argparse.ArgumentParser()
    configure(parser)
    settings = settings_from(parser.parse_args(["--pool", POOL]))
    metrics, subjects = PickerMetrics(CollectorRegistry()), Subjects()
    publisher = decision_publisher(settings, subjects, metrics)
    assert publisher is not None and publisher.decisions is not None
    link = _NatsLink(NatsSettings(url=nats_server.url), subjects, RegistryView(),
                     build_gateway(settings, metrics, publisher), metrics, publisher)
    accepted: list[str] = []  # picker ids of the batches the link's sink was given
    apply = link.decision_sink.accept

    def counting(subject: str, data: bytes) -> None:
        accepted.append(decode(data, DecisionBatch).picker)
        apply(subject, data)

    link.decision_sink.accept = counting  # type: ignore[method-assign]
    seen: list[str] = []  # picker ids an outside subscriber got

    async def outside(message) -> None:
        seen.append(decode(message.data, DecisionBatch).picker)

    await nc.subscribe(subjects.decisions(POOL), cb=outside)
    stop = asyncio.Event()
    task = asyncio.create_task(link.run(stop))
    try:
        await _wait_for(lambda: link.client is not None and link.client.is_connected)
        # The link subscribes right after connecting: a peer's batch shows when it is live.
        peer = encode(DecisionBatch("peer", POOL, time.time_ns(), [
            RoutedEvent(1, "pod-a", "m", Criticality.STANDARD)], 60.0))
        await _wait_for(lambda: "peer" in accepted, publish=lambda: nc.publish(
            subjects.decisions(POOL), peer))
        for request_id in range(10):
            publisher.decisions(POOL, RoutedEvent(request_id, "pod-a", "m",
                                                  Criticality.STANDARD))
        await _wait_for(lambda: publisher.picker_id in seen)
        # A second peer batch, sent after the server routed the link's own: an echo would be
        # on the link's connection ahead of it, and its subscription hands batches over in order.
        later = encode(DecisionBatch("peer-2", POOL, time.time_ns(), [], 60.0))
        await nc.publish(subjects.decisions(POOL), later)
        await _wait_for(lambda: "peer-2" in accepted)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
    assert publisher.picker_id in seen and set(accepted) == {"peer", "peer-2"}


async def _wait_for(condition: Callable[[], bool], within: float = 5.0,
                    publish: Callable[[], object] | None = None) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        if publish is not None:
            await publish()  # type: ignore[misc]
        await asyncio.sleep(0.02)
