"""Four real pickers behind one Envoy spread a steady load over equal pods as one would (issue
24): the default policy takes near-ties by least recent work, its own and its peers' (the
decision stream), so replicas deciding on the same snapshots do not herd onto one pod.

`lig up --pickers 4` (NATS, registry, collector, kv-events, 4 pickers, Envoy, 4 simulated pods),
a bounded run of short completions of the base model (no adapter, no shared prefix: every pod
is as good as another), counted from every picker's `lig_picker_requests_total` by pod.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from tests.support.lig_up import RunningStack, lig_up
from tests.test_up_e2e import BASE, completion, routed_by_target_and_pod

PICKERS = 4
PODS = 4
REQUESTS = 240
CONCURRENCY = 8


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with lig_up(tmp_path_factory.mktemp("replicas") / "state", "--pickers", str(PICKERS),
                "--pods", str(PODS)) as running:
        yield running


async def test_four_pickers_spread_equal_pods_evenly(stack: RunningStack) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        before = await routed_by_target_and_pod(client, stack)
        gate = asyncio.Semaphore(CONCURRENCY)

        async def send(i: int) -> int:
            async with gate:
                response = await client.post(f"{stack.gateway}/v1/completions",
                                             json=completion(BASE, i, max_tokens=16))
            return response.status_code

        statuses = await asyncio.gather(*(send(i) for i in range(REQUESTS)))
        after = await routed_by_target_and_pod(client, stack)
    assert Counter(statuses) == {200: REQUESTS}
    delta = after - before
    per_pod = Counter({pod: n for (target, pod, outcome), n in delta.items()
                       if target == BASE and outcome == "routed"})
    share = REQUESTS / PODS
    assert sum(per_pod.values()) == REQUESTS and len(per_pod) == PODS, per_pod
    # Every pod within half of its even share either way: replicas herding onto the pod that
    # looks emptiest put well over 1.5 shares on it. (At this light load a random pick among
    # ties spreads about as evenly: 45-66 of 60 in three runs, against 50-70 with least work;
    # the difference shows under stale metrics, in lig bench.)
    assert all(0.5 * share <= n <= 1.5 * share
               for n in per_pod.values()), per_pod


def test_every_picker_heard_its_peers(stack: RunningStack) -> None:
    """The spread above is the pickers' doing together: each applied its peers' decisions."""
    async def pages() -> list[str]:
        async with httpx.AsyncClient(timeout=10) as client:
            return [(await client.get(url)).text for url in stack.info.picker_metrics]

    texts = asyncio.run(pages())
    assert len(texts) == PICKERS
    for text in texts:
        applied = [line for line in text.splitlines()
                   if line.startswith("lig_picker_decision_events_applied_total ")]
        assert applied and float(applied[0].split()[1]) > 0, "a picker heard no peer"
