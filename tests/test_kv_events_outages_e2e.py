"""``lig kv-events`` through outages, end to end (real nats-server, ``lig sim`` pods publishing
KV events): NATS killed and restarted while the pods publish (every change is recorded, or past
the buffer a resync marker), and the bridge killed and restarted (it resumes from its
recording: no resync while the pods' replay buffers cover the downtime, one when they do not).

What the bridge published is judged on its recording (``LIG_KVBLOCKS``), which holds everything
NATS took, rather than on a live subscriber that would itself miss what came while it
reconnected."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from nats.aio.client import Client

from shared.kv_blocks import KVBlockChanges
from shared.kv_events import AllBlocksCleared
from tests.support.kv_events import EventPods, counter, gauge, recorded, register, until
from tests.support.nats_server import NatsServer
from tests.test_kv_events_e2e import followed, kv_events_process, output

# The recording's stream lives in JetStream's file store: it survives the NATS restarts.


def batches_of(changes: list[KVBlockChanges], pod: str) -> list[int]:
    return [c.source_seq for c in changes if c.pod == pod and c.source_seq >= 0]


def numbering_of(changes: list[KVBlockChanges], pod: str) -> list[int]:
    return [c.stream_seq for c in changes if c.pod == pod]


async def publish_batches(pods: EventPods, index: int, count: int, tag: str) -> int:
    """Requests on pod ``index`` until it published ``count`` more batches (a request makes one
    or two); returns its last sequence."""
    start = pods.kv_event_state(index)["seq"]
    request = 0
    while pods.kv_event_state(index)["seq"] < start + count:
        await asyncio.to_thread(pods.complete, index, f"{tag} {index} {request} " * 20)
        request += 1
    return int(pods.kv_event_state(index)["seq"])


async def all_recorded(nc: Client, pods: EventPods, names: list[str]) -> bool:
    """Whether every batch each pod published so far is in the recording."""
    changes = await recorded(nc)
    return all(batches_of(changes, name)[-1:] == [pods.kv_event_state(i)["seq"]]
               for i, name in enumerate(names))


async def test_every_change_made_while_nats_is_away_is_published_once_it_is_back(
    nc: Client, nats_server: NatsServer
) -> None:
    names = ["pod-0", "pod-1"]
    with EventPods(len(names), "map") as pods:
        await register(nc, [(name, pods.ports[i]) for i, name in enumerate(names)])
        with kv_events_process(nats_server.url, pods) as (_, metrics_port, log):
            await followed(metrics_port, len(names), log)
            for index in range(len(names)):
                await publish_batches(pods, index, 2, "before")
            await until(lambda: all_recorded(nc, pods, names), 20,
                        f"the changes before the outage recorded\n{output(log)}")

            nats_server.kill()
            for index in range(len(names)):
                await publish_batches(pods, index, 5, "while away")
            held = gauge(metrics_port, "lig_kv_events_buffered_messages")
            assert held >= 2 * 5, output(log)  # none dropped: held
            nats_server.start()
            restarted = time.monotonic()
            await until(lambda: all_recorded(nc, pods, names), 30,
                        f"the held changes recorded\n{output(log)}")
            took = time.monotonic() - restarted
            for index in range(len(names)):
                await publish_batches(pods, index, 2, "after")
            await until(lambda: all_recorded(nc, pods, names), 20,
                        f"the changes after the outage recorded\n{output(log)}")

            changes = await recorded(nc)
            for index, name in enumerate(names):
                # Every batch the pod published, once, in order; numbered without a hole.
                last = pods.kv_event_state(index)["seq"]
                assert batches_of(changes, name) == list(range(last + 1))
                assert numbering_of(changes, name) == list(range(len(numbering_of(changes,
                                                                                  name))))
            assert not any(c.resync for c in changes)
            assert gauge(metrics_port, "lig_kv_events_buffered_messages") == 0
            assert counter(metrics_port, "lig_kv_events_buffer_overflows_total") == 0
            assert "holding them" in output(log) and "published the" in output(log)
    print(f"held changes recorded {took:.2f} s after NATS restarted")


async def test_past_the_buffer_a_pod_gets_one_resync_marker_when_nats_is_back(
    nc: Client, nats_server: NatsServer
) -> None:
    with EventPods(1, "map") as pods:
        await register(nc, [("pod-0", pods.ports[0])])
        with kv_events_process(nats_server.url, pods, "--buffer-messages", "3") as (
                _, metrics_port, log):
            await followed(metrics_port, 1, log)
            await publish_batches(pods, 0, 2, "before")
            await until(lambda: all_recorded(nc, pods, ["pod-0"]), 20,
                        f"the changes before the outage recorded\n{output(log)}")
            before = len(await recorded(nc))

            nats_server.kill()
            await publish_batches(pods, 0, 8, "while away")
            nats_server.start()

            async def marker_recorded() -> bool:
                return any(c.resync for c in (await recorded(nc))[before:])

            await until(marker_recorded, 30, f"a resync marker\n{output(log)}")
            # Changes made once NATS is back follow the marker.
            last = await publish_batches(pods, 0, 1, "after")

            async def last_recorded() -> bool:
                return batches_of(await recorded(nc), "pod-0")[-1:] == [last]

            await until(last_recorded, 20, f"the changes after the marker\n{output(log)}")
            changes = await recorded(nc)
            after = changes[before:]
            markers = [c for c in after if c.resync]
            assert len(markers) == 1 and markers[0].ops == [AllBlocksCleared()]
            assert markers[0].source_seq == -1
            # Numbered in turn with the changes around it.
            assert numbering_of(changes, "pod-0") == list(range(len(changes)))
            assert after.index(markers[0]) == 0  # nothing held before it survived
            assert counter(metrics_port, "lig_kv_events_buffer_overflows_total") == 1
            assert counter(metrics_port, "lig_kv_events_buffer_dropped_total") >= 1
            assert output(log).count("replaced by a resync marker") == 1  # once per outage


async def killed_bridge_restarted(nc: Client, nats_server: NatsServer, buffer_steps: int,
                                  while_down: int) -> tuple[list[KVBlockChanges], int, Any]:
    """Kill the bridge (SIGKILL) after the pod's batches rolled over its replay buffer, let the
    pod publish ``while_down`` batches, start a new bridge: returns the recording, how many
    messages of it came before the new bridge, and the pod's last sequence."""
    with EventPods(1, "map", buffer_steps=buffer_steps) as pods:
        await register(nc, [("pod-0", pods.ports[0])])
        with kv_events_process(nats_server.url, pods) as (process, metrics_port, log):
            await followed(metrics_port, 1, log)
            # More batches than the buffer keeps: a replay from 0 could not cover them.
            await publish_batches(pods, 0, buffer_steps + 4, "before")
            await until(lambda: all_recorded(nc, pods, ["pod-0"]), 20,
                        f"the changes before the kill recorded\n{output(log)}")
            process.kill()
            process.wait()
        before = len(await recorded(nc))
        await publish_batches(pods, 0, while_down, "while down")
        with kv_events_process(nats_server.url, pods) as (_, metrics_port, log):
            await followed(metrics_port, 1, log)
            last = await publish_batches(pods, 0, 1, "after")

            async def reached_last() -> bool:
                return batches_of((await recorded(nc))[before:], "pod-0")[-1:] == [last]

            await until(reached_last, 30, f"the restarted bridge's changes\n{output(log)}")
            return await recorded(nc), before, last


async def test_a_restarted_bridge_resumes_where_it_was_recorded_without_a_resync(
    nc: Client, nats_server: NatsServer
) -> None:
    """The pods' replay buffer (8 batches) still holds the last batch recorded and those after
    it: the new bridge replays them, publishes no clear, and numbers on."""
    changes, before, last = await killed_bridge_restarted(nc, nats_server, 8, 3)
    after = changes[before:]
    assert not any(c.resync or AllBlocksCleared() in c.ops for c in after)
    assert batches_of(changes, "pod-0") == list(range(last + 1))  # each batch once
    assert numbering_of(changes, "pod-0") == list(range(len(changes)))


async def test_a_bridge_down_longer_than_the_pods_buffer_publishes_one_resync_marker(
    nc: Client, nats_server: NatsServer
) -> None:
    changes, before, _ = await killed_bridge_restarted(nc, nats_server, 4, 8)
    after = changes[before:]
    assert [c.resync for c in after].count(True) == 1 and after[0].resync
    assert after[0].ops == [AllBlocksCleared()]
    assert numbering_of(changes, "pod-0") == list(range(len(changes)))
