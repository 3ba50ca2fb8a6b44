"""Where one pod's next batch stands against the sequence seen so far (pure logic).

vLLM numbers batches 0, 1, 2, ... per engine process. A batch is applied when it is the next
one; a later one means batches were lost (replay them); an earlier one is either a duplicate
(the replay already delivered it: it is no newer than the newest batch applied) or a restarted
engine counting from 0 again (below anything a replay could have re-sent, or newer than every
batch applied). A later one can also come from a restarted engine whose first batches were
lost (its SUB connection was not back yet): a replay asked from the last batch applied tells,
since only the engine that sent that batch replays it with the same publish time.
"""

from __future__ import annotations

import enum

import msgspec

from shared.kv_blocks import KVBlockChanges


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
        self.last: tuple[int, float] | None = None
        """Sequence and publish time of the last batch applied: the engine still serving it
        replays exactly this batch, a restarted one has another (or none) at that sequence."""
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
        if ts is not None:
            self.last = (seq, ts)
            self.newest_ts = max(self.newest_ts, ts)

    def replaying(self) -> None:
        """A replay from ``expected`` starts: what it re-sends may arrive again."""
        self._floor = self.expected

    def skip_to(self, seq: int) -> None:
        """Batches before ``seq`` are lost for good: continue from ``seq``."""
        self.expected = seq
        self._floor = min(self._floor, seq)

    def resume(self, seq: int, ts: float) -> None:
        """Continue after batch ``seq`` (published at ``ts``), applied by an earlier bridge: the
        first replay is asked from it, which tells whether the engine that sent it still runs
        and its buffer still covers what came after."""
        self.applied(seq, ts)
        self._floor = self.expected

    def restart(self) -> None:
        """The engine restarted: its sequence starts again at 0."""
        self.expected = 0
        self._floor = 0
        self.newest_ts = float("-inf")
        self.last = None

    def same_engine(self, first: tuple[int, float] | None) -> bool | None:
        """Whether a replay asked from ``last`` comes from the engine that sent ``last``, given
        its first batch (seq, ts), None if it was empty: True when that batch is ``last``
        itself, False when the engine has another batch there or none that far (it counts from
        0 again), None when its buffer no longer reaches back to ``last`` (cannot tell)."""
        if self.last is None:
            return True
        if first is None:
            return False
        if first[0] == self.last[0]:
            return first[1] == self.last[1]
        return None if first[0] > self.last[0] else False


class ResumePoint(msgspec.Struct, frozen=True):
    """Where a pod-rank's stream goes on from, as the bridge's recording tells."""

    next_stream_seq: int
    """The number the next message published for the pod-rank takes."""
    last: tuple[int, float] | None
    """Sequence and publish time of the last vLLM batch published; None: none to continue
    from (the stream starts over with a replay from 0, as without a recording)."""


def resume_point(recorded: KVBlockChanges | None, address: str, dp_rank: int
                 ) -> ResumePoint | None:
    """How a stream of the pod-rank at ``address`` resumes from ``recorded``, the last message
    recorded on its pod's subject (None: nothing recorded, start as without a recording).

    Only a message of the same rank and address tells where the stream stood: another rank's
    (the subject is per pod) or another address's (another pod under the name) says nothing of
    this one, whose numbering then starts over. A marker's position is unknown (a restarted
    engine or a resync; the stream then went on from a replay from 0 or from the next batch
    heard), so the vLLM stream restarts from 0 while the numbering continues."""
    if recorded is None or recorded.dp_rank != dp_rank or recorded.address != address:
        return None
    last = (recorded.source_seq, recorded.ts) if recorded.source_seq >= 0 else None
    return ResumePoint(recorded.stream_seq + 1, last)
