"""KV-event fixtures shared by the suites and the benches: ``lig sim`` pods publishing KV
events, the registry entry that names them, the bridge's metrics page, and the recording
(``LIG_KVBLOCKS``) read back."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import msgspec
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from shared import kv_blocks
from shared.kv_blocks import KVBlockChanges
from shared.schemas import InferencePool
from shared.subjects import Subjects
from tests.support.collector import pod, put_pool, registry_bucket
from tests.support.ports import free_port_range
from tests.support.processes import die_with_parent
from tests.support.simulator import REPO_ROOT, SimulatedPods

SUBJECTS = Subjects()
PROMPT = "the quick brown fox jumps over the lazy dog " * 12


class EventPods(SimulatedPods):
    """Simulated pods publishing KV-cache events: PUB on ``events_base + i``, replay on
    ``replay_base + i``; ``hashes`` and ``framing`` as ``lig sim`` takes them (vLLM 0.33's
    uint64 hashes and topic-framed replay replies by default)."""

    def __init__(self, count: int, encoding: str, buffer_steps: int = 10_000,
                 hashes: str = "int", framing: str = "topic") -> None:
        base = free_port_range(2 * count)
        self.events_base, self.replay_base = base, base + count
        config = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{self.events_base}",
                  "replay_endpoint": f"tcp://*:{self.replay_base}",
                  "buffer_steps": buffer_steps, "topic": "kv"}
        super().__init__(count, time_scale=50.0, extra_args=[
            "--kv-events-config", msgspec.json.encode(config).decode(),
            "--kv-events-encoding", encoding, "--kv-events-hashes", hashes,
            "--kv-events-replay-framing", framing])

    def complete(self, index: int, prompt: str = PROMPT, max_tokens: int = 20) -> None:
        response = httpx.post(self.url(index) + "/v1/completions", timeout=10.0, json={
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens})
        response.raise_for_status()

    def restart(self, timeout: float = 30.0) -> None:
        """Stop the process and start a new one on the same ports (a restarted vLLM)."""
        self.stop()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "lig.cli", "sim", "--host", "127.0.0.1",
             "--base-port", str(self.ports[0]), *self._args],
            cwd=REPO_ROOT, env=os.environ | {"PYTHONPATH": str(REPO_ROOT)},
            stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(self.url(0) + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert self._process.poll() is None, self.output()
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.05)

    def kv_event_state(self, index: int) -> dict[str, Any]:
        """``{"drop": batches still to drop, "seq": last sequence published}`` of pod ``index``."""
        response = httpx.get(self.url(index) + "/admin/kv-events", timeout=5.0)
        response.raise_for_status()
        return response.json()

    def drop_next(self, index: int, count: int) -> dict[str, Any]:
        response = httpx.post(self.url(index) + "/admin/kv-events", json={"drop": count},
                              timeout=5.0)
        response.raise_for_status()
        return response.json()


def gauge(metrics_port: int, name: str) -> float:
    """Like :func:`counter`, -1 while the metrics server is not up yet."""
    try:
        return counter(metrics_port, name)
    except httpx.TransportError:
        return -1.0


def counter(metrics_port: int, name: str, label: str = "") -> float:
    """One sample of the consumer's Prometheus page (0 if absent)."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5.0).text
    for line in text.splitlines():
        if line.startswith(name + label + " "):
            return float(line.split()[-1])
    return 0.0


async def register(nc: Client, pods: list[tuple[str, int]]) -> None:
    kv = await registry_bucket(nc)
    await put_pool(kv, InferencePool(name="pool-a", target_port=pods[0][1]),
                   [pod(name, port) for name, port in pods])


async def recorded(nc: Client) -> list[KVBlockChanges]:
    """Every message of the recording, in order (empty while it cannot be read)."""
    js = nc.jetstream(timeout=2)
    try:
        state = (await js.stream_info(SUBJECTS.kv_blocks_stream)).state
    except Exception:  # NATS on its way back, or no stream yet: nothing recorded yet
        return []
    out = []
    for seq in range(state.first_seq, state.last_seq + 1):
        try:
            message = await js.get_msg(SUBJECTS.kv_blocks_stream, seq)
        except NotFoundError:
            continue
        out.append(kv_blocks.decode(message.data or b""))
    return out


async def until(condition: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    """Poll an async ``condition`` (``eventually`` for NATS reads)."""
    deadline = time.monotonic() + within
    while not await condition():
        assert time.monotonic() < deadline, f"not reached within {within}s: {what}"
        await asyncio.sleep(0.05)
