"""Steady requests (the engine's fast path): decoding requests the engine does not walk.

Most running requests are decoding: each step gives them one token to compute, ends with one
more token, and changes nothing else about them, except that every ``block_size`` tokens one
needs a new KV block and one block becomes full (and is offered to the prefix cache). Walking
all of them every step made the simulator slow, so a request that has emitted a token and not
finished becomes *steady*: the engine notes the step index from which it is steady
(``Request._steady_since``) and stops updating it. Its counts (``num_tokens``, ``num_output``,
...) are then its stored counts plus the number of steps ended since, and its token times are
those steps' end times, kept in the ``StepLog``; ``Request`` exposes them as properties, so
readers never see the difference. A step then:

- walks, in running order, the requests that are not steady (prefilling, recomputing, just
  admitted) exactly as before, together with the steady requests filed under this step index in
  the block events (``due``: those that need a block or fill one now: same allocation,
  preemption and prefix-cache registration, in the same order as a full walk would do them;
  when they only need a block each and blocks are plenty, ``_grow_at_once`` allocates them
  together);
- counts every steady request as one decode token and adds their total token count
  (``tokens``) to the context, without touching them;
- at its end, finishes the steady requests filed under this step in the finish events
  (``finishing``).

A request stops being steady (its counts are written back, ``Request._settle``) when it finishes,
is preempted or aborted. Counting steady requests without walking them is exact because the
budget never cuts a running request off, except the last one's prompt chunk: a request is
admitted only with budget left after all running ones (``serves_all_but_the_last``).
"""

from __future__ import annotations

from collections.abc import Sequence

from simulator.kv_cache import KVCache
from simulator.request import Request, running_order
from simulator.step_log import StepLog

LOG_CHUNK = 4096
"""Step end times kept beyond those the steady requests need, before trimming."""


class SteadyRequests:
    """The steady requests of one engine: how many, their context, and the steps at which each
    needs the engine's attention again (a block to allocate or fill, its last token)."""

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self.block_size = kv.block_size
        self.log = StepLog()
        self.log_limit = LOG_CHUNK
        self.count = 0
        """How many running requests are steady."""
        self.tokens = 0
        """The sum of their ``num_tokens``: the context they attend to in the next step."""
        self.block_events: dict[int, list[Request]] = {}
        """Steady requests by the step index at which they need a block or fill one."""
        self.finish_events: dict[int, list[Request]] = {}
        """Steady requests by the step index that gives them their last token."""

    def due(self, step: int, loose: Sequence[Request]) -> list[Request]:
        """The steady requests the walk of ``step`` must visit, in running order: those filed
        under it, unless they only needed a block each and got it here (``loose``: the running
        requests that are not steady)."""
        due = self.block_events.pop(step, [])
        due.sort(key=running_order)
        if due and self._grow_at_once(due, step, loose):
            return []
        return due

    def end_step(self, now: float) -> int:
        """The step in flight ended at ``now``: every steady request got a token stamped
        ``now`` (its context grew by one). Returns the index of that step."""
        log = self.log
        step = log.count
        log.append(now)
        self.tokens += self.count
        return step

    def finishing(self, step: int) -> list[Request]:
        """The steady requests whose last token came from ``step``, which just ended."""
        return self.finish_events.pop(step, [])

    def serves_all_but_the_last(
        self, budget: int, running: Sequence[Request], loose: Sequence[Request]
    ) -> bool:
        """True if every running request but the last gets all the tokens it wants (a steady
        request wants one) from ``budget``, so the budget cuts none of them off.

        This always holds: a request is admitted only with budget left after every running
        request, each one got at least one token in the last step, and all but the last of
        them caught up with their tokens then, so they want one token each now.
        """
        wanted = self.count + sum(r._num_tokens - r._num_computed for r in loose)
        last = running[-1]
        last_wants = 1 if last._steady_since >= 0 else last._num_tokens - last._num_computed
        return wanted - last_wants < budget

    def make_steady(self, request: Request) -> None:
        """Stop walking ``request`` (it just emitted a token and wants one per step from now)."""
        since = self.log.count
        request._steady_since = since
        self.count += 1
        self.tokens += request._num_tokens
        # Its last token comes from step ``since + tokens left - 1``.
        request._finish_step = since + request.max_tokens - request._num_output - 1
        self.finish_events.setdefault(request._finish_step, []).append(request)
        self.file_block_event(request)

    def file_block_event(self, request: Request) -> None:
        """File a steady request under the next step that needs a block for it or fills one."""
        # At step ``s`` it computes up to num_tokens + s - since tokens: it outgrows its blocks
        # at room + 1 and fills a block at _next_full.
        step = request._steady_since - request._num_tokens + request._room + 1
        if request.spec.output is not None:
            step = min(step, request._steady_since - request._num_tokens + request._next_full)
        # else the blocks it fills hold generated tokens unique to it: private, nothing to offer
        # (its full blocks are counted when it stops being steady, see unsteady).
        if step <= request._finish_step:
            request._block_step = step
            self.block_events.setdefault(step, []).append(request)
        else:
            request._block_step = -1

    def unsteady(self, request: Request) -> None:
        """Write a steady request's counts back into it and take it off the event lists."""
        self.count -= 1
        request._settle()
        self.tokens -= request._num_tokens
        full = request._num_computed // self.block_size
        if full > request._num_registered:  # the blocks it filled while steady, unoffered
            request._num_registered = full
            request._next_full = (full + 1) * self.block_size
        for events, step in (
            (self.block_events, request._block_step),
            (self.finish_events, request._finish_step),
        ):
            filed = events.get(step)
            if filed is not None:  # None: popped, this step's events are being handled
                filed.remove(request)
        request._block_step = request._finish_step = -1

    def trim_log(self, running: Sequence[Request]) -> None:
        """Forget the step end times older than every steady request's start, once the log has
        grown ``LOG_CHUNK`` entries beyond what they needed at the last trim."""
        log = self.log
        if len(log.ends) <= self.log_limit:
            return
        starts = [r._steady_since for r in running if r._steady_since >= 0]
        log.forget_before(min(starts, default=log.count))
        self.log_limit = len(log.ends) + LOG_CHUNK

    def _grow_at_once(self, due: list[Request], step: int, loose: Sequence[Request]) -> bool:
        """Give each of the steady requests ``due`` at ``step`` (in running order) its next
        block with a single allocation, if that is what the walk would do: they only need a
        block (their generated tokens are private, nothing to offer), they come before every
        request that is not steady, and there are blocks enough for all (no preemption)."""
        kv = self.kv
        if len(due) > kv.num_free or any(r.spec.output is not None for r in due):
            return False
        if loose and min(r._order for r in loose) < due[-1]._order:
            return False
        new_blocks = kv.allocate(len(due))
        assert new_blocks is not None  # checked just above
        block_size = self.block_size
        next_step = step + block_size  # one token per step: the new block is full by then
        refiled = []
        for request, block in zip(due, new_blocks, strict=True):
            request.blocks.append(block)
            request._room += block_size
            if next_step <= request._finish_step:
                request._block_step = next_step
                refiled.append(request)
            else:
                request._block_step = -1
        if refiled:
            self.block_events.setdefault(next_step, []).extend(refiled)
        return True
