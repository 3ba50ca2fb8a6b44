"""The registry's control loop: keep the KV bucket equal to the newest valid input.

Every ``watch_interval`` the input files are read and compared with the last read; a change (or a
forced reload, SIGHUP) parses and validates them. A valid input becomes the desired state and is
published; an invalid one is logged (its first problems, one a line) and counted, and the
previous desired state stays published. A publish pass also runs after a NATS reconnect and every
``resync_interval`` (someone may have wiped or edited the bucket); a failed pass is retried with a
bounded backoff.

A valid input that would remove every pool, or every endpoint of a pool (an emptied file or
folder), is refused unless ``allow_empty``: nothing is written, the refusal is logged and counted,
and the desired state goes back to the last one published (none at a first start, so that the
bucket keeps what an earlier run left there).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Sequence

import nats.errors

from services.registry.files import FileSnapshot, load, read_files
from services.registry.loader import InvalidRegistry, Registry
from services.registry.metrics import RegistryMetrics
from services.registry.name_conflicts import model_name_conflicts
from services.registry.overrides import EndpointsOverride, apply_override
from services.registry.publisher import Plan, Publisher, RemovalRefused
from shared.logs import RateLimitedLog
from shared.waits import wait_set

log = logging.getLogger("lig.registry")

RETRY_MIN = 0.5
RETRY_MAX = 5.0
# A changed input is read again this much later and used only if unchanged, so that a file caught
# half-written (truncated, then written) is not published as "no objects".
SETTLE = 0.1
KEYS_LOGGED = 5  # a pass names this many of the keys it wrote, then counts the rest
PROBLEMS_LOGGED = 20  # an invalid input logs this many of its problems, then counts the rest


async def _load_in_thread(snapshot: FileSnapshot) -> Registry:
    """:func:`load` off the event loop (inputs within the limits can take minutes to parse),
    given up at its next document if this task is cancelled (the registry is stopping)."""
    cancel = threading.Event()
    loading = asyncio.ensure_future(asyncio.to_thread(load, snapshot, cancel.is_set))
    try:
        return await asyncio.shield(loading)
    except asyncio.CancelledError:
        cancel.set()
        # Whatever the load ends with (LoadCancelled, most likely) no longer matters; waiting
        # for it means no thread outlives the task.
        with contextlib.suppress(Exception):
            await loading
        raise


class Reconciler:
    """Watches the inputs and republishes them; owns the last good desired state."""

    def __init__(
        self,
        paths: Sequence[str],
        metrics: RegistryMetrics,
        *,
        watch_interval: float = 0.5,
        resync_interval: float = 30.0,
        allow_empty: bool = False,
        override: EndpointsOverride | None = None,
    ) -> None:
        self.paths = tuple(paths)
        self.desired: Registry | None = None
        self.published: Registry | None = None  # the newest state a pass published in full
        self._allow_empty = allow_empty
        self._override = override
        self._metrics = metrics
        self._watch_interval = watch_interval
        self._resync_interval = resync_interval
        self._snapshot: FileSnapshot | None = None
        self._wake = asyncio.Event()
        self._force_reload = False
        self._publish_pending = False
        self._retry_delay = 0.0
        self._retry_at = 0.0
        self._next_resync = float("inf")
        self._publish_errors = RateLimitedLog(log)

    def request_reload(self) -> None:
        """Re-read and republish the inputs now, even if unchanged (SIGHUP)."""
        self._force_reload = True
        self._wake.set()

    def request_resync(self) -> None:
        """Check the bucket against the desired state now (after a NATS reconnect)."""
        self._publish_pending = True
        self._retry_at = 0.0
        self._wake.set()

    async def check_inputs(self) -> None:
        """Reload the inputs if they changed (or a reload was requested)."""
        forced, self._force_reload = self._force_reload, False
        if not forced and self._snapshot is not None and self._watch_interval <= 0:
            return  # watching disabled: reload only on request
        snapshot = await asyncio.to_thread(read_files, self.paths)
        if not forced and snapshot == self._snapshot:
            return
        await asyncio.sleep(SETTLE)
        settled = await asyncio.to_thread(read_files, self.paths)
        if settled != snapshot and not forced:
            return  # still being written: look again on the next check
        snapshot = self._snapshot = settled
        try:
            desired = await _load_in_thread(snapshot)
        except InvalidRegistry as exc:
            # Bounded: one bad file can hold millions of problems (a duplicate key per line).
            for problem in exc.problems[:PROBLEMS_LOGGED]:
                log.error("invalid input: %s", problem)
            kept = "the previous state stays published" if self.desired else "nothing published"
            shown = (f", the first {PROBLEMS_LOGGED} logged; lig registry --check lists them all"
                     if len(exc.problems) > PROBLEMS_LOGGED else "")
            log.error("rejected the inputs (%d problems%s); %s", len(exc.problems), shown, kept)
            self._metrics.reload_invalid()
            return
        except Exception:
            # Every input error is an InvalidRegistry; anything else is a bug of ours, which must
            # not take the registry (and `lig up` with it) down or change what is published.
            log.exception("could not load the inputs (a registry bug: please report it with "
                          "the input); the previous state stays published")
            self._metrics.reload_invalid()
            return
        if self._override is not None:
            desired, found = apply_override(desired, self._override)
            if not found:
                log.warning("--endpoints-override names pool %r, which the inputs do not define",
                            self._override.pool)
        self._metrics.reload_ok(desired)
        if forced or desired != self.desired:
            log.info("loaded %d pools, %d models, %d endpoint sets from %d files",
                     len(desired.pools), len(desired.models), len(desired.endpoint_sets),
                     len(snapshot.files))
            if not desired.pools:
                log.warning("the inputs define no pools")
            for conflict in model_name_conflicts(desired):
                log.warning("%s", conflict)
            self.desired = desired
            self.request_resync()

    async def run(self, publisher: Publisher) -> None:
        """Watch, reload and publish until cancelled."""
        self._publish_pending = True
        while True:
            now = time.monotonic()
            if now >= self._next_resync:
                self._publish_pending = True
                self._next_resync = now + self._resync_interval
            await self.check_inputs()
            if self._publish_pending and self.desired is not None and now >= self._retry_at:
                await self._publish(publisher, self.desired)
            await self._sleep()

    async def _publish(self, publisher: Publisher, desired: Registry) -> None:
        try:
            done = await publisher.publish(desired, allow_empty=self._allow_empty)
        except RemovalRefused as exc:
            self._refused(exc)
            return
        except (nats.errors.Error, TimeoutError, OSError) as exc:
            self._metrics.publish_failed()
            self._retry_delay = min(max(RETRY_MIN, self._retry_delay * 2), RETRY_MAX)
            self._retry_at = time.monotonic() + self._retry_delay
            self._publish_errors.warning("publishing failed, retrying in %.1f s: %s",
                                         self._retry_delay, str(exc) or type(exc).__name__)
            return
        self._metrics.published(done)
        self.published = desired
        self._publish_pending = False
        self._retry_delay = 0.0
        self._next_resync = time.monotonic() + (self._resync_interval or float("inf"))
        if done.puts or done.deletes:
            log.info("published: %d put, %d deleted, %d unchanged (%s)", len(done.puts),
                     len(done.deletes), done.unchanged, written_keys(done))
        else:
            log.debug("bucket already up to date (%d keys)", done.unchanged)

    def _refused(self, exc: RemovalRefused) -> None:
        """Keep the last published state (or none) after a refused pass; say so loudly."""
        self._metrics.refused(exc.refusal.reason, self.published)
        kept = ("the previous state stays published" if self.published is not None
                else "nothing published; the bucket keeps what it holds")
        log.error("REFUSED to publish: %s; %s. Restore the inputs, or run with --allow-empty "
                  "(env LIG_REGISTRY_ALLOW_EMPTY=1) if this is intended", exc.refusal.message, kept)
        self.desired = self.published
        self._publish_pending = self.desired is not None

    async def _sleep(self) -> None:
        now = time.monotonic()
        deadlines = [self._next_resync]
        if self._watch_interval > 0:
            deadlines.append(now + self._watch_interval)
        if self._publish_pending and self.desired is not None:
            deadlines.append(self._retry_at)
        timeout = max(0.0, min(deadlines) - now)
        await wait_set(self._wake, None if timeout == float("inf") else timeout)
        self._wake.clear()


def written_keys(done: Plan) -> str:
    """The first few keys a pass wrote (deletes marked ``-``) and how many more, for its log line:
    a pass of 10,000 models would otherwise log every key on one line."""
    keys = [key for key, _ in done.puts[:KEYS_LOGGED]]
    keys += [f"-{key}" for key in done.deletes[:KEYS_LOGGED - len(keys)]]
    more = len(done.puts) + len(done.deletes) - len(keys)
    return ", ".join(keys) + (f" and {more:,} more" if more else "")
