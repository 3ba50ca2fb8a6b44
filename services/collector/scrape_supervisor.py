"""Keeps exactly one scrape loop running per pod this collector owns.

:meth:`ScrapeSupervisor.reconcile` is given the wanted targets whenever the registry or the set
of live collectors changes; it stops loops of pods no longer wanted, starts loops for new ones and
restarts a loop whose target moved (new address or metrics URL). A restarted loop waits for its
predecessor to finish, so even then two scrapes of one pod never overlap.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

from services.collector.targets import ScrapeTarget

log = logging.getLogger("lig.collector.scrape_supervisor")

RESTART_DELAY_S = 1.0


class ScrapeSupervisor:
    """Runs ``loop(target)`` for every wanted target; ``stopped(target)`` runs after each ends."""

    def __init__(
        self,
        loop: Callable[[ScrapeTarget], Awaitable[None]],
        stopped: Callable[[ScrapeTarget], None] = lambda target: None,
        restart_delay_s: float = RESTART_DELAY_S,
    ) -> None:
        self._loop = loop
        self._restart_delay_s = restart_delay_s
        self._stopped = stopped
        self._running: dict[str, tuple[ScrapeTarget, asyncio.Task[None]]] = {}

    @property
    def targets(self) -> dict[str, ScrapeTarget]:
        """The targets being scraped, by pod key."""
        return {key: target for key, (target, _) in self._running.items()}

    def reconcile(self, wanted: Mapping[str, ScrapeTarget]) -> None:
        """Make the running loops match ``wanted`` (by pod key)."""
        for key in list(self._running):
            if key not in wanted:
                _, task = self._running.pop(key)
                task.cancel()
        for key, target in wanted.items():
            current = self._running.get(key)
            if current is not None and current[0] == target:
                continue
            previous = None
            if current is not None:
                previous = current[1]
                previous.cancel()
            task = asyncio.create_task(self._run(target, previous), name=f"scrape {key}")
            self._running[key] = (target, task)

    async def stop(self) -> None:
        """Cancel every loop and wait for them to end."""
        tasks = [task for _, task in self._running.values()]
        self._running.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _run(self, target: ScrapeTarget, previous: asyncio.Task[None] | None) -> None:
        if previous is not None:
            await asyncio.wait([previous])
        try:
            while True:
                try:
                    await self._loop(target)
                    return
                except Exception:  # a bug in one pod's loop must not stop the others
                    log.exception("scrape loop of %s/%s failed; restarting", target.pool,
                                  target.pod)
                    await asyncio.sleep(self._restart_delay_s)
        finally:
            self._stopped(target)
