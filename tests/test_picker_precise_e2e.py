"""The precise prefix index end to end: ``lig sim`` pods publishing KV-cache events on ZMQ,
``lig kv-events`` republishing them on a real nats-server, and the picker's side reading them.

The first test runs the picker's own feed and router in this process with the simulator's
tokenizer (``builtin:lig-sim``, ``scheduling/prompt_tokenizers.py``); the second runs
``lig picker`` itself and checks through its metrics that its index holds exactly the blocks
the pods announced. ``tests/test_precise_routing_e2e.py`` routes through Envoy with
``lig picker --tokenizer``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from collections.abc import Callable
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from scheduling import lig_sim_tokenizer as tokenizer
from scheduling.precise_index import PreciseIndex
from scheduling.prompt_tokenizers import SimTokenizer
from scheduling.token_blocks import block_keys, root_key
from services.picker.kv_blocks_feed import KVBlocksSink, subscribe
from services.picker.routing import Routed, Router
from services.picker.state import PodTable
from shared import kv_blocks
from shared.registry_view import RegistryView
from shared.schemas import EndpointSet, InferencePool, PodMetrics, PolicyConfig
from shared.subjects import Subjects
from tests.support.collector import pod
from tests.support.nats_sync import subscribed, synced
from tests.support.picker import PickerProcess
from tests.support.waiting import eventually
from tests.test_kv_events_e2e import EventPods, followed, kv_events_process, output, register

SUBJECTS = Subjects()
POOL = "pool-a"
SHARED = "You are the fleet's assistant and answer in one word. " * 40
OTHER = "Translate every sentence into French, then count its words. " * 40


def keys_of(prompt: str) -> list[int]:
    return block_keys(tokenizer.encode(prompt), 16, root_key(None))


def full_blocks(prompt: str) -> int:
    return len(tokenizer.encode(prompt)) // 16


def pool_router(pods: EventPods) -> Router:
    """A prefix-aware router over the simulated pods, fresh snapshots for both."""
    router = Router(POOL, PodTable(stale_after=3600.0), random.Random(1))
    view = RegistryView()
    view.pools[POOL] = InferencePool(name=POOL, target_port=pods.ports[0],
                                     policy=PolicyConfig("prefix-aware"))
    endpoints = tuple(pod(f"pod-{i}", port) for i, port in enumerate(pods.ports))
    view.endpoints[POOL] = EndpointSet(pool=POOL, endpoints=endpoints)
    view.models[POOL] = {}
    router.update(view)
    for seq, endpoint in enumerate(endpoints, start=1):
        router.pods.apply(PodMetrics(pool=POOL, pod=endpoint.name, address=endpoint.hostport,
                                     seq=seq, scrape_time_ns=seq, scrape_duration_s=0.0,
                                     ok=True))
    router.tokenizer = SimTokenizer()
    return router


def pick(router: Router, prompt: str) -> str:
    result = router.route(msgspec.json.encode({"model": "m", "prompt": prompt,
                                               "max_tokens": 5}))
    assert isinstance(result, Routed), result
    router.pods.finished(result.pod)  # never started: keeps the pods equally idle
    return result.pod


async def test_requests_go_to_the_pod_whose_events_show_their_prefix(
    nc: Client, nats_server: Any
) -> None:
    with EventPods(2, "map") as pods:
        await register(nc, [("pod-0", pods.ports[0]), ("pod-1", pods.ports[1])])
        router = pool_router(pods)
        skipped: list[str] = []
        sink = KVBlocksSink(lambda pool: (router.precise, router.pods) if pool == POOL else None,
                            on_skip=skipped.append)
        await subscribe(nc, SUBJECTS, sink, [POOL])
        await synced(nc)
        with kv_events_process(nats_server.url, pods) as (_, metrics_port, log):
            await followed(metrics_port, 2, log)
            # Warm the caches directly (bypassing any picker): the picker learns it only
            # from the pods' events.
            await asyncio.to_thread(pods.complete, 0, SHARED + "first question")
            await asyncio.to_thread(pods.complete, 1, OTHER + "first sentence")
            shared, other = keys_of(SHARED), keys_of(OTHER)

            def learnt() -> bool:
                return (router.precise.match(shared).get("pod-0", 0) >= len(shared)
                        and router.precise.match(other).get("pod-1", 0) >= len(other))

            await eventually(learnt, within=20,
                             what=f"the pods' blocks in the index\n{output(log)}")
            assert router.precise.event_pods() == {"pod-0", "pod-1"}
            assert "pod-1" not in router.precise.match(shared)
            assert not skipped
            assert router.precise.stats.skipped["parent"] == 0
            for question in range(4):
                assert pick(router, SHARED + f"question {question}") == "pod-0"
                assert pick(router, OTHER + f"sentence {question}") == "pod-1"
            # A restarted engine: lig kv-events clears it, and so does the index.
            await asyncio.to_thread(pods.restart)
            # Both pods' clears: each comes in its own message, in any order.
            await eventually(lambda: not router.precise.match(shared)
                             and not router.precise.match(other), within=20,
                             what=f"the restarted pods' blocks dropped\n{output(log)}")
            await eventually(lambda: len(router.precise) == 0, within=5,
                             what=f"{len(router.precise)} blocks left\n{output(log)}")


class Announced:
    """Every block change ``lig kv-events`` published, applied to an index of the test's own:
    what a picker should hold."""

    def __init__(self) -> None:
        self.index = PreciseIndex(100_000)
        self.last_seq: dict[str, int] = {}

    async def on_message(self, message: Msg) -> None:
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            changes = kv_blocks.decode(message.data)
            self.index.apply(changes)
            if changes.source_seq >= 0:
                self.last_seq[changes.pod] = changes.source_seq

    def has_all_of(self, pods: EventPods) -> bool:
        """Whether the last batch each pod published has arrived (a completion's events come
        in a message per engine step; the last may still be on its way after the first)."""
        return all(self.last_seq.get(f"pod-{i}") == pods.kv_event_state(i)["seq"]
                   for i in range(pods.count))


def metric(picker: PickerProcess, name: str) -> float | None:
    """The sample ``name`` (with its labels) of the picker's metrics page, None if absent (or
    the page does not answer yet)."""
    try:
        page = picker.metrics()
    except OSError:
        return None
    for line in page.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


UNDECODABLE = 'lig_picker_kv_blocks_skipped_total{reason="undecodable"}'


async def garbage_counted(nc: Client, picker: PickerProcess, count: float) -> None:
    """Publish garbage on the pool's subject until the picker has counted ``count`` such
    messages (the first call also shows its subscription is up)."""
    for _ in range(200):  # bounded: 20 s at most
        await nc.publish(SUBJECTS.kv_blocks(POOL, "pod-0"), b"\xc1 not msgpack")
        await nc.flush()
        await asyncio.sleep(0.1)
        if (metric(picker, UNDECODABLE) or 0.0) >= count:
            return
    raise AssertionError(f"the picker did not count garbage messages\n{picker.log()}")


async def test_lig_pickers_index_holds_the_blocks_the_pods_announced(
    nc: Client, nats_server: Any, picker_process: Callable[..., PickerProcess]
) -> None:
    announced = Announced()
    await subscribed(nc, SUBJECTS.all_kv_blocks(), cb=announced.on_message)
    expected = announced.index
    with EventPods(2, "array") as pods:
        await register(nc, [("pod-0", pods.ports[0]), ("pod-1", pods.ports[1])])
        picker = picker_process(POOL, nats_server.url,
                                extra_args=("--precise-blocks", "100000"))
        await garbage_counted(nc, picker, 1.0)  # subscribed: bad payloads counted, not fatal
        with kv_events_process(nats_server.url, pods) as (_, _, log):
            for index in range(6):
                await asyncio.to_thread(pods.complete, index % 2,
                                        (SHARED if index % 2 else OTHER) + f"number {index}")
            await eventually(lambda: announced.has_all_of(pods), within=20,
                             what=f"every pod's last batch\n{output(log)}")

            def agrees() -> bool:
                return (metric(picker, f'lig_picker_precise_blocks{{pool="{POOL}"}}')
                        == len(expected) > 0
                        and metric(picker, f'lig_picker_precise_event_pods{{pool="{POOL}"}}')
                        == 2.0)

            await eventually(agrees, within=20, what=f"the picker's index\n{picker.log()}")
            stored = metric(picker, f'lig_picker_precise_blocks_stored_total{{pool="{POOL}"}}')
            assert stored == expected.stats.stored > 0
            before = metric(picker, UNDECODABLE) or 0.0
            await garbage_counted(nc, picker, before + 1)
            assert picker.process is not None and picker.process.poll() is None


async def test_a_picker_started_after_the_pods_reads_the_blocks_they_hold(
    nc: Client, nats_server: Any, picker_process: Callable[..., PickerProcess]
) -> None:
    """vLLM announces a block once: a picker that starts later learns the blocks the pods
    already hold from lig kv-events' recording; without it (--no-precise-history) it does not."""
    announced = Announced()
    await subscribed(nc, SUBJECTS.all_kv_blocks(), cb=announced.on_message)
    with EventPods(2, "map") as pods:
        await register(nc, [("pod-0", pods.ports[0]), ("pod-1", pods.ports[1])])
        with kv_events_process(nats_server.url, pods) as (_, metrics_port, log):
            await followed(metrics_port, 2, log)
            for index in range(4):
                await asyncio.to_thread(pods.complete, index % 2,
                                        (SHARED if index % 2 else OTHER) + f"number {index}")
            await eventually(lambda: announced.has_all_of(pods), within=20,
                             what=f"every pod's last batch\n{output(log)}")
            held = len(announced.index)
            assert held > 0
            later = picker_process(POOL, nats_server.url, extra_args=("--precise-blocks", "1000"))
            # Serving every pool (as lig up, compose and Kubernetes run pickers), its pools come
            # from the registry: the recording must still be read whole.
            every_pool = picker_process("", nats_server.url,
                                        extra_args=("--precise-blocks", "1000"))
            live_only = picker_process(POOL, nats_server.url,
                                       extra_args=("--precise-blocks", "1000",
                                                   "--no-precise-history"))
            blocks = f'lig_picker_precise_blocks{{pool="{POOL}"}}'
            await eventually(lambda: metric(later, blocks) == held, within=20,
                             what=f"the recorded blocks in the later picker\n{later.log()}")
            await eventually(lambda: metric(every_pool, blocks) == held, within=20,
                             what=f"the recorded blocks, every pool served\n{every_pool.log()}")
            skipped = 'lig_picker_kv_blocks_skipped_total{reason="pool"}'
            assert not metric(every_pool, skipped), every_pool.log()
            await garbage_counted(nc, live_only, 1.0)  # it is subscribed, and up to date
            assert metric(live_only, blocks) == 0.0
            assert "reading LIG_KVBLOCKS from its start" in later.log()
            # Its ordered consumers do not hold up a clean stop.
            started = time.monotonic()
            later.signal(signal.SIGTERM)
            assert await asyncio.to_thread(later.wait, 10) == 0
            assert time.monotonic() - started < 5, later.log()
