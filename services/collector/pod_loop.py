"""The scrape loop of one pod: scrape, publish, wait, again; back off while the pod fails.

One loop per pod, each scrape awaited before the next starts, so scrapes of a pod never overlap.
"""

from __future__ import annotations

import asyncio
import random
import time

import msgspec

from services.collector.publisher import SnapshotPublisher
from services.collector.scraper import Scraper
from services.collector.targets import ScrapeTarget


class Cadence(msgspec.Struct, frozen=True):
    """How often to scrape a pod, and how far to back off from a failing one."""

    interval_s: float
    max_backoff_s: float

    def delay_after(self, failures: int) -> float:
        """Seconds from one scrape's start to the next, after ``failures`` failures in a row.

        A healthy pod is scraped every interval; a failing one at 2, 4, 8... intervals, capped at
        ``max_backoff_s`` (never below the interval), so a dead pod costs little yet its return
        is noticed within the cap.
        """
        if failures <= 0:
            return self.interval_s
        cap = max(self.interval_s, self.max_backoff_s)
        return min(cap, self.interval_s * 2.0 ** min(failures, 32))


def first_seq() -> int:
    """Where a pod loop starts counting: the wall clock in milliseconds.

    A loop scrapes at most once a millisecond, so a loop started later (after a restart, or on
    another collector that took the pod over) always counts above the one it replaces: a pod's
    ``seq`` only grows, whoever scrapes it.
    """
    return time.time_ns() // 1_000_000


async def run_pod_loop(
    target: ScrapeTarget,
    scraper: Scraper,
    publisher: SnapshotPublisher,
    cadence: Cadence,
    phase_s: float | None = None,
) -> None:
    """Scrape ``target`` until cancelled, publishing every snapshot (ok or not).

    The first scrape waits a random ``phase_s`` within one interval, so that pods added together
    are not all scraped in the same instant.
    """
    loop = asyncio.get_running_loop()
    seq = first_seq()
    failures = 0
    await asyncio.sleep(random.uniform(0, cadence.interval_s) if phase_s is None else phase_s)
    due = loop.time()
    while True:
        seq += 1
        snapshot = await scraper.scrape(target, seq)
        await publisher.publish(target.subject, snapshot)
        failures = 0 if snapshot.ok else failures + 1
        # Scrapes are due on a fixed grid, so timer lateness does not add up into a lower rate;
        # a scrape that overran its slot is followed at once, never by a burst of catch-ups.
        due = max(due + cadence.delay_after(failures), loop.time())
        await asyncio.sleep(due - loop.time())
