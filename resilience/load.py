"""Steady, bounded client traffic through Envoy, with every outcome recorded.

Requests start on a fixed schedule (open loop: a slow gateway does not slow the arrivals), at
most ``rate * duration`` of them, each bounded by ``timeout``. A request is lost when it gets no
200 (an error status, a transport error or no answer in time); a 200 whose ``model`` is not the
requested name (a rewrite leaking through) is counted separately.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter

import httpx
import msgspec

from resilience.stack import BASE_MODEL, SPLIT_MODEL

MODELS = (BASE_MODEL, SPLIT_MODEL)


class Outcome(msgspec.Struct, frozen=True):
    """One request: when it started (monotonic), how it ended, in how long."""

    started: float
    status: int  # 0: no HTTP answer
    error: str  # "" for a 200 naming the requested model
    seconds: float


class LoadRun:
    """Outcomes of one load run; filled while it runs."""

    def __init__(self) -> None:
        self.outcomes: list[Outcome] = []

    def between(self, start: float, end: float) -> list[Outcome]:
        """Outcomes of requests started in [start, end) (monotonic seconds)."""
        return [o for o in self.outcomes if start <= o.started < end]

    @staticmethod
    def lost(outcomes: list[Outcome]) -> list[Outcome]:
        """Those without a 200."""
        return [o for o in outcomes if o.status != 200]

    @staticmethod
    def wrong_model(outcomes: list[Outcome]) -> list[Outcome]:
        """200s whose body names another model than the one requested."""
        return [o for o in outcomes if o.status == 200 and o.error]

    @staticmethod
    def achieved_rate(outcomes: list[Outcome]) -> float:
        """Requests started per second: below the asked rate when this client was starved."""
        if len(outcomes) < 2:
            return 0.0
        starts = [o.started for o in outcomes]
        span = max(starts) - min(starts)
        return (len(outcomes) - 1) / span if span > 0 else 0.0

    @staticmethod
    def causes(outcomes: list[Outcome]) -> str:
        """The most common failures, e.g. ``503 x12, ReadTimeout x3``."""
        counts = Counter(f"{o.status}" if o.status else o.error for o in outcomes
                         if o.status != 200)
        return ", ".join(f"{cause} x{count}" for cause, count in counts.most_common(3))


async def _one(client: httpx.AsyncClient, url: str, model: str, run: LoadRun) -> None:
    started = time.monotonic()
    body = {"model": model, "prompt": "Say hello", "max_tokens": 2}
    try:
        response = await client.post(url, json=body)
    except httpx.HTTPError as exc:
        run.outcomes.append(Outcome(started, 0, type(exc).__name__, time.monotonic() - started))
        return
    error = ""
    if response.status_code == 200:
        try:
            named = msgspec.json.decode(response.content).get("model")
        except (msgspec.DecodeError, AttributeError):
            named = None
        if named != model:
            error = f"answer names model {named!r}"
    else:
        error = response.text[:200]
    run.outcomes.append(Outcome(started, response.status_code, error,
                                time.monotonic() - started))


async def steady_load(gateway: str, rate: float, duration: float, run: LoadRun,
                      request_timeout: float = 20.0) -> LoadRun:
    """Send ``rate`` requests a second for ``duration`` seconds; wait for every answer."""
    url = f"{gateway}/v1/completions"
    count = int(rate * duration)
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=request_timeout, limits=limits, trust_env=False) as client:
        tasks = []
        begin = time.monotonic()
        for index, model in zip(range(count), itertools.cycle(MODELS), strict=False):
            delay = begin + index / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, url, model, run)))
        await asyncio.gather(*tasks)
    return run
