"""Find a recorded decision by request id and run its policy again, explained (pure logic of
``lig explain --recording``).

Every DecisionRecord whose ``request_id`` is the one asked for is re-run (several pickers may
have recorded the same request: a retry through another replica), each with the pool's policy
as the registry stood at that point of the file and the recorded draw (the draw contract of
:mod:`recording.rerun`), and paired with its OutcomeRecord when the file holds one. The file is
streamed once; only the matches are kept.
"""

from __future__ import annotations

from typing import BinaryIO

import msgspec

from recording.records import ReadCounts, Registry, find_records
from recording.rerun import Rerunner, recorded_policy, scheduling_request
from scheduling import Decision, PolicyConfigError
from scheduling.record import DecisionRecord, OutcomeRecord, recorded_request_id
from shared.schemas import PolicyConfig


class RecordedDecision(msgspec.Struct):
    """One recorded decision of the request and its explained re-run."""

    frame_ns: int
    picker: str
    pool: str
    record: DecisionRecord
    policy: PolicyConfig
    fallback: bool  # the registry named another policy or no pool: the record's, defaults
    decision: Decision | None  # None: the policy does not build (``error``)
    error: str = ""
    outcome: OutcomeRecord | None = None

    @property
    def rerun_pick(self) -> str | None:
        """The re-run's pick (None: shed, no pod, or not re-run)."""
        if self.decision is None or self.decision.pick is None:
            return None
        return self.decision.pick.name

    @property
    def agrees(self) -> bool:
        """Whether the re-run chose what was recorded (the same pod, or both shed or both
        without a pod)."""
        return (self.decision is not None and self.rerun_pick == self.record.pick
                and self.decision.shed == self.record.shed)


def find(source: BinaryIO, request_id: str,
         counts: ReadCounts | None = None) -> list[RecordedDecision]:
    """The decisions recorded for ``request_id`` in ``source`` (positioned after its header),
    in file order, each re-run with ``explain=True``; :class:`~recording.fileformat.
    RecordingError` on a truncated or corrupt file."""
    # Cut as the picker cut the header (a longer id, or one with bytes that are not UTF-8).
    request_id = recorded_request_id(request_id.encode("utf-8", "surrogateescape"))
    registry = Registry()
    found: list[RecordedDecision] = []
    by_key: dict[tuple[str, str, int], RecordedDecision] = {}
    for item in find_records(source, registry, counts if counts is not None else ReadCounts(),
                             request_id):
        record = item.record
        key = (item.picker, item.pool, record.seq)
        if isinstance(record, OutcomeRecord):
            match = by_key.get(key)
            if match is not None and match.outcome is None:
                match.outcome = record
            continue
        recorded = recorded_policy(registry, item.pool, record)
        decision: Decision | None = None
        error = ""
        try:
            # A fresh policy: a stateful one (round-robin) lacks its earlier decisions here.
            decision = Rerunner().decide("recorded", recorded.tag, recorded.config,
                                         item.picker, item.pool, record,
                                         scheduling_request(record), explain=True)
        except PolicyConfigError as exc:
            error = str(exc)
        found.append(RecordedDecision(item.frame_ns, item.picker, item.pool, record,
                                      recorded.config, recorded.fallback, decision, error))
        by_key[key] = found[-1]
    return found
