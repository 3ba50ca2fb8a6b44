"""Where one pod's next batch stands against the sequence seen so far (pure logic).

vLLM numbers batches 0, 1, 2, ... per engine process. A batch is applied when it is the next
one; a later one means batches were lost (replay them); an earlier one is either a duplicate
(the replay already delivered it: it is no newer than the newest batch applied) or a restarted
engine counting from 0 again (below anything a replay could have re-sent, or newer than every
batch applied).
"""

from __future__ import annotations

import enum


class Verdict(enum.Enum):
    """What to do with a batch."""

    APPLY = "apply"
    DUPLICATE = "duplicate"
    GAP = "gap"
    RESET = "reset"


class SequenceTracker:
    """The next sequence number expected from one pod, and the lowest a duplicate can have."""

    def __init__(self) -> None:
        self.expected = 0
        self.newest_ts = float("-inf")
        """The publish time of the newest batch applied."""
        self._floor = 0
        """The first sequence of the last replay: batches from there to ``expected`` may come
        again on the PUB socket (it kept delivering while the replay ran)."""

    def classify(self, seq: int, ts: float) -> Verdict:
        """The verdict on batch ``seq``, published at ``ts``, received from the PUB socket."""
        if seq == self.expected:
            # PUB delivers in order: nothing before this batch can arrive again.
            self._floor = seq
            return Verdict.APPLY
        if seq > self.expected:
            return Verdict.GAP
        if seq >= self._floor and ts <= self.newest_ts:
            return Verdict.DUPLICATE
        return Verdict.RESET

    def applied(self, seq: int, ts: float | None = None) -> None:
        """Batch ``seq`` (published at ``ts``, if known) was applied or given up on: the next
        one is expected."""
        self.expected = seq + 1
        if ts is not None and ts > self.newest_ts:
            self.newest_ts = ts

    def replaying(self) -> None:
        """A replay from ``expected`` starts: what it re-sends may arrive again."""
        self._floor = self.expected

    def skip_to(self, seq: int) -> None:
        """Batches before ``seq`` are lost for good: continue from ``seq``."""
        self.expected = seq
        self._floor = min(self._floor, seq)

    def restart(self) -> None:
        """The engine restarted: its sequence starts again at 0."""
        self.expected = 0
        self._floor = 0
        self.newest_ts = float("-inf")
