"""What-if: re-decide every recorded decision with other policies and compare (pure logic).

Open loop: each policy decides on the views as recorded, and those views were shaped by the
recorded decisions (a pod the recorded policy loaded looks loaded to every policy), so the
report says what each policy would have chosen at each moment, not how the fleet would have
evolved under it. ``lig bench --trace-from-recording`` closes the loop on a simulated fleet.

"Differ most": among the choices for one decision (the recorded one and each policy's), the
gap between the most and the least loaded pod chosen, load being the view's waiting + running
+ in-flight requests; a decision where one choice sheds or finds no pod and another picks a pod
ranks above every gap.
"""

from __future__ import annotations

import heapq
import itertools
from operator import attrgetter
from typing import BinaryIO

import msgspec

from recording.fileformat import FileHeader
from recording.records import ReadCounts, Recorded, Registry, config_tag, read_records
from recording.rerun import (
    PolicySpec,
    Rerunner,
    recorded_policy,
    scheduling_request,
)
from scheduling import PolicyConfigError
from scheduling.record import DecisionRecord
from scheduling.types import PodView

OPEN_LOOP_NOTE = (
    "open loop: every policy re-decides on the views as recorded, and those views were shaped "
    "by the recorded decisions; for a closed loop (the fleet reacting to each policy) run "
    "'lig bench --trace-from-recording FILE'")
AS_RECORDED = "as recorded"


class PoolSpread(msgspec.Struct):
    """How one pool's picks spread over its pods (every pod seen in a view, picked or not)."""

    picks: dict[str, int]
    share: dict[str, float]
    max_over_mean: float  # busiest pod's picks / mean picks per pod; 1.0 is perfectly even


class PolicyReport(msgspec.Struct):
    """One policy's decisions over the file, compared with the recorded ones."""

    policy: str
    decisions: int = 0
    agree: int = 0  # same pod, or both shed, or both without a pod
    agreement: float = 0.0
    picks: int = 0
    shed: int = 0
    shed_agree: int = 0  # shed where the recording shed too
    shed_extra: int = 0  # shed where the recording did not
    shed_missed: int = 0  # not shed where the recording did
    no_pick: int = 0  # no pod and no shed (the picker answers 503)
    shed_by_criticality: dict[str, int] = {}
    pools: dict[str, PoolSpread] = {}
    fallbacks: int = 0  # recorded: the registry named another policy or no pool; defaults used
    unbuildable: int = 0  # decisions skipped: the policy does not build (e.g. a newer lig's)


class Choice(msgspec.Struct):
    """One policy's (or the recording's) answer to a decision."""

    policy: str
    pick: str | None
    shed: bool
    load: int | None  # waiting + running + in flight of the picked pod in the view


class Difference(msgspec.Struct):
    """A decision the choices differ on, with each choice."""

    time_ns: int
    picker: str
    pool: str
    request_id: str
    seq: int
    model: str
    criticality: str
    load_gap: int
    shed_differs: bool
    choices: list[Choice]


class WhatIfReport(msgspec.Struct):
    """What ``lig replay --what-if`` prints (``--json``: this object)."""

    note: str
    from_ns: int
    to_ns: int
    pool: str | None
    decisions: int
    outcomes: int
    undecodable: int
    recorded: PolicyReport
    policies: list[PolicyReport]
    top: int
    differences: list[Difference]


class _Tally:
    """Counters for one column (a policy, or the recording itself)."""

    __slots__ = ("picks", "report", "shed_by_criticality")

    def __init__(self, label: str) -> None:
        self.report = PolicyReport(label)
        self.picks: dict[str, dict[str, int]] = {}
        self.shed_by_criticality: dict[str, int] = {}

    def count(self, pool: str, record: DecisionRecord, pick: str | None, shed: bool) -> None:
        report = self.report
        report.decisions += 1
        if pick is not None:
            report.picks += 1
            pods = self.picks.get(pool)
            if pods is None:
                pods = self.picks[pool] = {}
            pods[pick] = pods.get(pick, 0) + 1
        elif shed:
            report.shed += 1
            key = record.criticality.value
            self.shed_by_criticality[key] = self.shed_by_criticality.get(key, 0) + 1
        else:
            report.no_pick += 1
        if pick == record.pick and shed == record.shed:
            report.agree += 1
        if shed and record.shed:
            report.shed_agree += 1
        elif shed:
            report.shed_extra += 1
        elif record.shed:
            report.shed_missed += 1

    def finish(self, pods_seen: dict[str, set[str]]) -> PolicyReport:
        report = self.report
        report.agreement = report.agree / report.decisions if report.decisions else 0.0
        report.shed_by_criticality = dict(sorted(self.shed_by_criticality.items()))
        report.pools = {pool: _spread(self.picks.get(pool, {}), seen)
                        for pool, seen in sorted(pods_seen.items())}
        return report


def _spread(picks: dict[str, int], seen: set[str]) -> PoolSpread:
    counts = {pod: picks.get(pod, 0) for pod in sorted(seen | picks.keys())}
    total = sum(counts.values())
    share = {pod: count / total if total else 0.0 for pod, count in counts.items()}
    mean = total / len(counts) if counts else 0.0
    return PoolSpread(counts, share, max(counts.values()) / mean if mean else 0.0)


_NAME = attrgetter("name")


def _load(view: PodView) -> int:
    return view.waiting + view.running + view.in_flight


class WhatIf:
    """Re-decides recorded decisions with each spec and keeps the tallies and the ``top``
    decisions that differ most (bounded: a heap of ``top``)."""

    def __init__(self, specs: list[PolicySpec], top: int) -> None:
        self.specs = specs
        self.top = top
        self.rerunner = Rerunner()
        self.recorded = _Tally(AS_RECORDED)
        self.tallies = [_Tally(spec.label) for spec in specs]
        self._tags = [config_tag(spec.config) if spec.config else None for spec in specs]
        self.pods_seen: dict[str, set[str]] = {}
        self._heap: list[tuple[tuple[int, int, int, int], Difference]] = []
        self._order = itertools.count()

    def add(self, item: Recorded, registry: Registry) -> None:
        """Re-decide one recorded decision (outcome records are ignored)."""
        record = item.record
        if type(record) is not DecisionRecord:
            return
        pool = item.pool
        seen = self.pods_seen.get(pool)
        if seen is None:
            seen = self.pods_seen[pool] = set()
        seen.update(map(_NAME, record.view))
        recorded_pick, recorded_shed = record.pick, record.shed
        self.recorded.count(pool, record, recorded_pick, recorded_shed)
        request = scheduling_request(record)
        answers: list[tuple[str, PodView | None, bool]] = []
        differs = False
        for spec, tally, fixed_tag in zip(self.specs, self.tallies, self._tags, strict=True):
            if spec.config is None or fixed_tag is None:
                recorded = recorded_policy(registry, pool, record)
                tag, config = recorded.tag, recorded.config
                if recorded.fallback:
                    tally.report.fallbacks += 1
            else:
                tag, config = fixed_tag, spec.config
            try:
                decision = self.rerunner.decide(spec.label, tag, config, item.picker, pool,
                                                record, request)
            except PolicyConfigError:
                tally.report.unbuildable += 1
                continue
            view = decision.pick
            pick = view.name if view is not None else None
            tally.count(pool, record, pick, decision.shed)
            answers.append((spec.label, view, decision.shed))
            if pick != recorded_pick or decision.shed != recorded_shed:
                differs = True
        if differs and self.top > 0:
            self._keep(item, record, answers)

    def _keep(self, item: Recorded, record: DecisionRecord,
              answers: list[tuple[str, PodView | None, bool]]) -> None:
        picked = {record.pick is not None, *(answer[1] is not None for answer in answers)}
        shed_differs = len(picked) > 1
        full = len(self._heap) >= self.top
        if full and self._heap[0][0][0] > shed_differs:
            return  # the list holds only shed differences, and this is none
        recorded_view = None
        if record.pick is not None:
            for view in record.view:
                if view.name == record.pick:
                    recorded_view = view
                    break
        loads = [_load(view) for view in (recorded_view, *(answer[1] for answer in answers))
                 if view is not None]
        gap = max(loads) - min(loads) if loads else 0
        # Ties: the earlier decision first (a later time, or a later place in the file, ranks
        # lower). The key is checked before anything is built: most decisions do not make it.
        key = (int(shed_differs), gap, -record.time_ns, -next(self._order))
        if full and key <= self._heap[0][0]:
            return
        choices = [Choice(AS_RECORDED, record.pick, record.shed,
                          _load(recorded_view) if recorded_view is not None else None)]
        choices.extend(Choice(label, view.name if view is not None else None, shed,
                              _load(view) if view is not None else None)
                       for label, view, shed in answers)
        difference = Difference(
            record.time_ns, item.picker, item.pool, record.request_id, record.seq, record.model,
            record.criticality.value, gap, shed_differs, choices)
        if len(self._heap) < self.top:
            heapq.heappush(self._heap, (key, difference))
        else:
            heapq.heapreplace(self._heap, (key, difference))

    def report(self, header: FileHeader, counts: ReadCounts, pool: str | None) -> WhatIfReport:
        """The report so far."""
        ranked = [difference for _, difference in sorted(self._heap, key=lambda entry: entry[0],
                                                         reverse=True)]
        return WhatIfReport(
            note=OPEN_LOOP_NOTE, from_ns=header.from_ns, to_ns=header.to_ns,
            pool=pool if pool is not None else header.pool, decisions=counts.decisions,
            outcomes=counts.outcomes, undecodable=counts.undecodable,
            recorded=self.recorded.finish(self.pods_seen),
            policies=[tally.finish(self.pods_seen) for tally in self.tallies],
            top=self.top, differences=ranked)


def what_if(source: BinaryIO, header: FileHeader, specs: list[PolicySpec], top: int,
            pool: str | None = None) -> WhatIfReport:
    """Read ``source`` (positioned after its header) and compare ``specs`` on every recorded
    decision; :class:`~recording.fileformat.RecordingError` on a truncated or corrupt file."""
    registry = Registry()
    counts = ReadCounts()
    comparison = WhatIf(specs, top)
    for item in read_records(source, registry, counts, pool, outcomes=False):
        comparison.add(item, registry)
    return comparison.report(header, counts, pool)
