"""``lig up`` with KV-cache events, as a user runs it: its simulated pods publish events, its one
``lig kv-events`` republishes them, and block changes of every pod arrive on NATS
(``<prefix>.kvblocks.<pool>.<pod>``) for requests sent through its Envoy. The bridge is
supervised like every service: its death stops the stack with a report."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import httpx
import nats
import pytest

from shared import kv_blocks
from shared.kv_blocks import KVBlockChanges
from shared.kv_events import BlockStored
from shared.subjects import Subjects
from tests.support.lig_up import RunningStack, lig_up
from tests.support.nats_sync import subscribed
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(120)

PODS = ["vllm-0", "vllm-1", "vllm-2"]
POOL = "vllm-llama3-8b-instruct"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
MAX_REQUESTS = 90  # bounds the loop in count (the deadline bounds it in time)
WITHIN_S = 45.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    state_dir = tmp_path_factory.mktemp("lig-up-kv") / "state"
    with lig_up(state_dir, "--pods", str(len(PODS)), "--pickers", "1",
                "--sim-args", "--time-scale 20") as running:
        yield running


def prompt(i: int) -> str:
    """A prompt of several full 16-token blocks, different for every request."""
    return f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 10


async def test_block_changes_of_every_pod_arrive_on_nats(stack: RunningStack) -> None:
    info = stack.info
    received: list[KVBlockChanges] = []
    subjects: set[str] = set()

    async def on_message(message: object) -> None:
        subjects.add(message.subject)  # type: ignore[attr-defined]
        received.append(kv_blocks.decode(message.data))  # type: ignore[attr-defined]

    def stored_by() -> set[str]:
        return {c.pod for c in received if any(isinstance(op, BlockStored) for op in c.ops)}

    nc = await nats.connect(info.nats_url)
    try:
        await subscribed(nc, Subjects(info.prefix).all_kv_blocks(), cb=on_message)
        deadline = time.monotonic() + WITHIN_S
        sent = 0
        async with httpx.AsyncClient(timeout=30) as client:
            # Envoy and the picker choose the pods: send until each has stored blocks.
            while stored_by() != set(PODS) and sent < MAX_REQUESTS \
                    and time.monotonic() < deadline:
                response = await client.post(f"{stack.gateway}/v1/completions", json={
                    "model": MODEL, "prompt": prompt(sent), "max_tokens": 4})
                assert response.status_code == 200, response.text
                sent += 1
                await asyncio.sleep(0.05)
        # The last request's events may still be on their way.
        await eventually(lambda: stored_by() == set(PODS),
                         within=max(1.0, deadline - time.monotonic()),
                         what=f"stored blocks of every pod after {sent} requests, got "
                              f"{sorted(stored_by())}\n{stack.output()}")
    finally:
        await nc.close()

    subject = Subjects(info.prefix)
    assert {subject.kv_blocks(POOL, pod) for pod in PODS} <= subjects
    ports = {f"127.0.0.1:{port}" for port in info.ports}
    for changes in received:
        assert changes.pool == POOL and changes.address in ports
        assert not changes.resync, changes  # nothing lost on loopback
    # The blocks carry the simulator's token ids: what a precise index keys on.
    assert any(op.token_ids for c in received for op in c.ops if isinstance(op, BlockStored))


def test_kv_events_is_supervised_like_every_service(stack: RunningStack) -> None:
    [row] = [line for line in stack.lines if line.lstrip().startswith("kv-events ")]
    assert ".kvblocks.>" in row, row
    pid = int(row.rsplit("[pid ", 1)[1].rstrip("]"))
    os.kill(pid, signal.SIGKILL)
    code = stack.process.wait(15)
    stack.read_to_end()
    assert code == 1, stack.output()
    assert any(f"kv-events (pid {pid}) was killed by SIGKILL" in line
               for line in stack.lines), stack.output()
    assert stack.lines[-1] == "lig up: stopped", stack.output()
