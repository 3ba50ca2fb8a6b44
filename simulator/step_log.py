"""When each step of one engine ended: the timeline steady requests read their token times from.

A steady request (see ``steady``) is not updated while it decodes; its token times are the end
times of the steps since it became steady, kept here once for all of them.
"""

from __future__ import annotations


class StepLog:
    """When each step of one engine ended: where steady requests read their token times.

    Step ``i`` (counting from 0) ended at ``ends[i - first]``, ``gaps[i - first]`` after step
    ``i - 1``: the time between the tokens a steady request got from those two steps. The engine
    drops the entries no steady request needs any more, so a long real-time run stays small.
    """

    __slots__ = ("ends", "first", "gaps")

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.gaps: list[float] = []
        self.first = 0
        """Index of the step whose end is ``ends[0]``."""

    @property
    def count(self) -> int:
        """Steps ended so far, which is also the index of the step in flight, if any."""
        return self.first + len(self.ends)

    def append(self, end: float) -> None:
        """Record that the step in flight ended at ``end``."""
        ends = self.ends
        self.gaps.append(end - ends[-1] if ends else 0.0)
        ends.append(end)

    def forget_before(self, step: int) -> None:
        """Drop the entries of the steps before ``step`` (keeping at least the last one)."""
        drop = min(step, self.count - 1) - self.first
        if drop > 0:
            del self.ends[:drop]
            del self.gaps[:drop]
            self.first += drop
