"""What a request is: its spec as submitted (``RequestSpec``) and its record of progress
(``Request``), which the engine's modules update and drivers read.

A steady request (see ``steady``) is not updated while it decodes: ``Request`` then adds the
steps ended since it became steady (read from the engine's ``StepLog``) to its stored counts and
token times, so readers never see the difference.

Fields whose names start with ``_`` belong to the engine's modules (``engine``, ``steady``,
``prefix_sharing``, ``block_hashes``); drivers read the public fields and properties only.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable
from operator import attrgetter

import msgspec

from simulator.step_log import StepLog

NEVER = 1 << 62
"""A block index no request reaches."""


class SyntheticPrompt(msgspec.Struct, frozen=True):
    """A prompt described by runs of ``(seed, length)`` tokens instead of token ids."""

    segments: tuple[tuple[int, int], ...]

    @property
    def length(self) -> int:
        """Number of tokens."""
        return sum(length for _, length in self.segments)


class RequestSpec(msgspec.Struct, frozen=True):
    """One request as submitted: what to compute, not how far it got."""

    request_id: str
    prompt: tuple[int, ...] | SyntheticPrompt
    max_tokens: int
    """Tokens to generate; the request finishes after exactly this many."""
    adapter: str | None = None
    output: tuple[int, ...] | None = None
    """Ids of the generated tokens (at least ``max_tokens``); None: unique to this request."""
    finish_reason: str = "length"
    """Reported when the request completes: "length" (hit max_tokens) or "stop" (EOS)."""


class Status(enum.IntEnum):
    """Where a request is in the engine."""

    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Request:
    """A submitted request and its progress; the engine mutates it, drivers read it.

    While the request is steady (see ``steady``) the fields behind ``num_tokens``,
    ``num_computed``, ``num_output``, ``last_token_time``, ``last_gap``, ``max_gap`` and
    ``token_times`` hold their values at ``_steady_since``; the properties add the steps since.
    """

    __slots__ = (
        "_abort",
        "_block_step",
        "_finish_step",
        "_ids",
        "_last_gap",
        "_last_token_time",
        "_log",
        "_max_gap",
        "_next_full",
        "_num_computed",
        "_num_offered",
        "_num_output",
        "_num_published",
        "_num_registered",
        "_num_tokens",
        "_order",
        "_parked_blocks",
        "_parked_position",
        "_private_from",
        "_room",
        "_segment_ends",
        "_segment_keys",
        "_segment_seeds",
        "_steady_since",
        "_token_times",
        "adapter",
        "arrival_time",
        "block_hashes",
        "blocks",
        "finish_reason",
        "finish_time",
        "first_scheduled_time",
        "first_token_time",
        "max_tokens",
        "num_cached_tokens",
        "num_prompt_tokens",
        "preemptions",
        "request_id",
        "serial",
        "spec",
        "status",
        "step_tokens",
        "watcher",
    )

    def __init__(
        self, spec: RequestSpec, serial: int, arrival_time: float, num_prompt: int, log: StepLog
    ):
        self.spec = spec
        self.request_id = spec.request_id
        self.adapter = spec.adapter
        self.serial = serial
        self.arrival_time = arrival_time
        self.num_prompt_tokens = num_prompt
        self.max_tokens = spec.max_tokens
        self._num_tokens = num_prompt
        self._num_computed = 0
        self._num_output = 0
        self.blocks: list[int] = []
        self.block_hashes: list[int] = []
        self._num_registered = 0  # its full blocks: the first ones, computed or being computed
        self._num_offered = 0  # its first blocks offered to the prefix cache (<= _num_registered)
        self._private_from = NEVER  # its first block no other request can share (prefix_sharing)
        self._num_published = 0  # its first blocks offered when it was preempted
        self._next_full = 0  # context length at which another block is full (to register)
        self._parked_blocks: list[int] | None = None  # its blocks, freed with private content
        self._parked_position = 0  # the free queue position its last block took then
        self._room = 0  # tokens the allocated blocks hold
        self.num_cached_tokens = -1
        self.preemptions = 0
        self.status = Status.WAITING
        self.step_tokens = 0
        """Tokens scheduled for it in the step in flight (not kept up to date while steady)."""
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self._last_token_time = 0.0
        self._last_gap = 0.0
        self._max_gap = 0.0
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self._token_times: list[float] | None = None
        self.watcher: Callable[[], None] | None = None
        """Called by real-time drivers after each token and at the end."""
        self._abort = False
        self._log = log
        self._steady_since = -1  # index of the first step it got a token from while steady
        self._order = 0  # position in the running list: larger = admitted later
        self._block_step = -1  # the step it is filed under in SteadyRequests' block events
        self._finish_step = -1  # the step it is filed under in SteadyRequests' finish events
        prompt = spec.prompt
        self._ids = prompt if isinstance(prompt, tuple) else None
        segments = () if isinstance(prompt, tuple) else prompt.segments
        self._segment_ends = list(itertools.accumulate(length for _, length in segments))
        self._segment_seeds = [seed for seed, _ in segments]
        # What stands for a segment's tokens in block contents: its seed, doubled because
        # CPython hashes -1 like -2 (equal hashes would make two texts share cached blocks).
        self._segment_keys = [2 * seed for seed, _ in segments]

    @property
    def finished(self) -> bool:
        """True once the request completed or was aborted."""
        return self.status is Status.FINISHED

    @property
    def num_tokens(self) -> int:
        """Tokens of its context: the prompt and every token generated so far."""
        return self._num_tokens + self._steady_steps()

    @property
    def num_computed(self) -> int:
        """Tokens of its context whose KV is computed (all but the newest while decoding)."""
        return self._num_computed + self._steady_steps()

    @property
    def num_output(self) -> int:
        """Tokens generated so far."""
        return self._num_output + self._steady_steps()

    @property
    def last_token_time(self) -> float:
        """When its newest token was emitted (0.0 before the first)."""
        return self._log.ends[-1] if self._steady_steps() else self._last_token_time

    @property
    def last_gap(self) -> float:
        """Seconds between its two newest tokens (0.0 before the second)."""
        return self._log.gaps[-1] if self._steady_steps() else self._last_gap

    @property
    def max_gap(self) -> float:
        """The longest time between two of its consecutive tokens so far."""
        if self._steady_steps():
            log = self._log
            steady = max(log.gaps[self._steady_since - log.first :])
            return steady if steady > self._max_gap else self._max_gap
        return self._max_gap

    @property
    def token_times(self) -> list[float] | None:
        """Every token's time, when the engine config has ``record_token_times``."""
        times = self._token_times
        if times is not None and self._steady_steps():
            log = self._log
            return times + log.ends[self._steady_since - log.first :]
        return times

    def _steady_steps(self) -> int:
        """Tokens it got while steady and not yet written to its fields (0 when not steady)."""
        since = self._steady_since
        return self._log.count - since if since >= 0 else 0

    def _settle(self) -> None:
        """Write the tokens it got while steady into its fields; it is no longer steady."""
        steps = self._steady_steps()
        if steps:
            log = self._log
            start, end = self._steady_since - log.first, log.count - log.first
            self._num_tokens += steps
            self._num_computed += steps
            self._num_output += steps
            self._last_token_time = log.ends[end - 1]
            self._last_gap = log.gaps[end - 1]
            steady_max = max(log.gaps[start:end])
            if steady_max > self._max_gap:
                self._max_gap = steady_max
            if self._token_times is not None:
                self._token_times += log.ends[start:end]
        self._steady_since = -1


running_order = attrgetter("_order")
"""Sort key of running requests: the order of their admission, which is the running order."""
