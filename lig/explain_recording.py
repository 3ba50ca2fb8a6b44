"""``lig explain --recording FILE --request-id ID``: print a recorded decision as ``lig explain``
prints a decision, plus what was recorded about it (the pure logic: recording/explain_recorded.py).

Text: for each recorded decision of the request (several pickers may have recorded it), the
``lig explain`` output of the re-run, a ``recorded:`` line (time, picker, pool, the recorded
pick, whether the re-run agrees) and an ``outcome:`` line when the file holds the outcome.
``--json``: one object, ``{"request_id", "recording", "decisions": [...]}``, each decision with
the ``lig explain --json`` object under ``explain``. Exit 1 for an id the file does not hold, 2
for a bad file or a recorded policy this lig cannot build.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import msgspec

from lig.explain_output import ExplainOutput, RequestEntry, explain_output, render
from recording.explain_recorded import RecordedDecision, find
from recording.fileformat import RecordingError, read_header
from recording.records import ReadCounts
from recording.window import format_time
from scheduling import Decision
from scheduling.record import OutcomeRecord
from shared.errors import InputError, LigError
from shared.schemas import PolicyConfig


class DecisionNotFound(LigError):
    """The recording holds no decision for the request id (exit 1: the file itself is fine)."""


class RecordedOutput(msgspec.Struct):
    """One recorded decision in ``--json``."""

    time: str
    time_ns: int
    picker: str
    pool: str
    seq: int
    policy: PolicyConfig
    params_fallback: bool  # the registry named another policy or no pool: default params
    recorded_pick: str | None
    recorded_shed: bool
    agrees: bool
    explain: ExplainOutput
    outcome: dict[str, Any] | None


class RecordingExplainOutput(msgspec.Struct):
    """What ``lig explain --recording ... --json`` prints."""

    request_id: str
    recording: str
    decisions: list[RecordedOutput]


def run_recorded(path: Path, request_id: str, as_json: bool) -> int:
    """Find, re-run and print; 0, or 2 when a decision found cannot be re-run. Raises
    :class:`InputError` for an unreadable file, :class:`DecisionNotFound` for an absent id."""
    counts = ReadCounts()
    try:
        with path.open("rb") as source:
            read_header(source)
            found = find(source, request_id, counts)
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except RecordingError as exc:
        raise InputError(f"{path}: {exc}") from None
    if not found:
        skipped = (f", {counts.undecodable} undecodable records or batches skipped"
                   if counts.undecodable else "")
        raise DecisionNotFound(f"no decision with request id {request_id!r} in {path} "
                               f"({counts.decisions} decisions read{skipped})")
    broken = [match for match in found if match.decision is None]
    for match in broken:
        print(f"lig explain: {path}: the decision of {match.picker} at "
              f"{format_time(match.record.time_ns)} cannot be re-run: {match.error}",
              file=sys.stderr)
    shown = [(match, match.decision) for match in found if match.decision is not None]
    if as_json:
        print(msgspec.json.encode(RecordingExplainOutput(
            request_id, str(path), [_output(match, decision) for match, decision in shown])
        ).decode())
    else:
        print("\n\n".join(_text(match, decision) for match, decision in shown))
    return 2 if broken else 0


def _request(match: RecordedDecision) -> RequestEntry:
    record = match.record
    return RequestEntry(record.model, record.target_model, record.criticality)


def _output(match: RecordedDecision, decision: Decision) -> RecordedOutput:
    record = match.record
    outcome = msgspec.structs.asdict(match.outcome) if match.outcome is not None else None
    return RecordedOutput(
        format_time(record.time_ns), record.time_ns, match.picker, match.pool, record.seq,
        match.policy, match.fallback, record.pick, record.shed, match.agrees,
        explain_output(match.policy.name, _request(match), decision),
        outcome)


def _text(match: RecordedDecision, decision: Decision) -> str:
    record = match.record
    lines = [render(match.policy.name, _request(match), len(record.view), decision)]
    recorded = record.pick or ("shed" if record.shed else "no pod")
    if match.agrees:
        verdict = "the re-run agrees"
    else:
        verdict = f"the re-run DISAGREES (it chose {match.rerun_pick or 'no pod'})"
    fallback = (" (the recorded registry has no pool with this policy: its default params)"
                if match.fallback else "")
    lines.append(f"recorded: {format_time(record.time_ns)} by {match.picker}, pool "
                 f"{match.pool}, seq {record.seq}: pick {recorded}; {verdict}{fallback}")
    if match.outcome is not None:
        lines.append(f"outcome: {_outcome(match.outcome)}")
    return "\n".join(lines)


def _outcome(outcome: OutcomeRecord) -> str:
    ttfb = f"{outcome.ttfb_ms:.1f} ms" if outcome.ttfb_ms is not None else "no body"
    usage = ("usage not reported" if outcome.prompt_tokens is None
             else f"{outcome.prompt_tokens} prompt + {outcome.completion_tokens or 0} "
                  "completion tokens")
    return (f"served by {outcome.served}, status {outcome.status}, first byte {ttfb}, "
            f"done after {outcome.duration_ms:.1f} ms, {usage}{_reuse(outcome)}")


def _reuse(outcome: OutcomeRecord) -> str:
    """The prompt tokens found cached against the prefix index's prediction (nothing for a
    recording older than the fields, which has neither)."""
    if outcome.cached_tokens is None and outcome.predicted_cached_tokens is None:
        return ""
    observed = ("cached tokens not reported" if outcome.cached_tokens is None
                else f"{outcome.cached_tokens} cached")
    predicted = ("" if outcome.predicted_cached_tokens is None
                 else f" (predicted {outcome.predicted_cached_tokens})")
    return f", {observed}{predicted}"
