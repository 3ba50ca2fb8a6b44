"""``lig replay FILE --what-if --policies A,B``: the flags, and the report as text or JSON."""

from __future__ import annotations

import argparse
from typing import BinaryIO

import msgspec

from recording.fileformat import FileHeader, RecordingError
from recording.rerun import parse_policy_specs
from recording.whatif import Difference, PolicyReport, WhatIfReport, what_if
from recording.window import format_time
from scheduling import PolicyConfigError
from shared.errors import ConfigError, InputError

DEFAULT_TOP = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The what-if flags of ``lig replay``."""
    group = parser.add_argument_group(
        "what-if (offline: no NATS)",
        "re-decide every recorded decision with other policies and compare them with the "
        "recorded picks (open loop: docs/recording.md)")
    group.add_argument("--what-if", action="store_true",
                       help="compare policies on the recorded decisions instead of publishing")
    group.add_argument("--policies", default=None, metavar="A,B",
                       help="policies to compare, comma-separated: 'recorded' (each pool's "
                            "recorded policy), a policy name, or NAME:{JSON params}, e.g. "
                            "recorded,least-queue,'filter-tree:{\"kv_cache_threshold\":0.9}'")
    group.add_argument("--pool", default=None, help="only this pool's decisions")
    group.add_argument("--top", type=int, default=DEFAULT_TOP, metavar="N",
                       help="list the N decisions the choices differ most on")
    group.add_argument("--json", action="store_true", help="print one JSON object")


def misused(args: argparse.Namespace) -> str | None:
    """The flag given without ``--what-if`` that needs it, if any."""
    for flag, given in (("--policies", args.policies is not None), ("--pool", args.pool),
                        ("--json", args.json), ("--top", args.top != DEFAULT_TOP)):
        if given:
            return flag
    return None


def run(args: argparse.Namespace, source: BinaryIO, header: FileHeader) -> int:
    """Compare and print; :class:`ConfigError` or :class:`InputError` (exit 2) on bad flags or
    a bad file."""
    if not args.policies:
        raise ConfigError("--what-if needs --policies (e.g. --policies recorded,least-queue)")
    if args.top < 0:
        raise ConfigError("--top must be >= 0")
    try:
        specs = parse_policy_specs(args.policies)
    except PolicyConfigError as exc:
        raise ConfigError(f"--policies: {exc}") from None
    try:
        report = what_if(source, header, specs, args.top, args.pool)
    except RecordingError as exc:
        raise InputError(f"{args.file}: {exc}") from None
    if args.json:
        print(msgspec.json.encode(report).decode())
    else:
        print(render(report, args.file))
    return 0


def render(report: WhatIfReport, name: str) -> str:
    """The report as text."""
    pool = f"pool {report.pool}" if report.pool else "every pool"
    lines = [
        f"what-if on {name} ({pool}, {format_time(report.from_ns)} .. "
        f"{format_time(report.to_ns)}): {report.decisions} decisions, {report.outcomes} "
        f"outcomes, {report.undecodable} undecodable record batches skipped",
        f"NOTE: {report.note}",
        "",
    ]
    columns = [report.recorded, *report.policies]
    lines.extend(_summary(columns))
    for pool_name in report.recorded.pools:
        lines.append("")
        lines.extend(_spread(pool_name, columns))
    lines.append("")
    lines.extend(_differences(report))
    return "\n".join(lines)


def _summary(columns: list[PolicyReport]) -> list[str]:
    width = max(len(column.policy) for column in columns)
    lines = [f"{'policy':<{width}}  {'decisions':>9}  {'agree':>7}  {'picks':>7}  "
             f"{'shed':>6}  {'no pod':>6}  shed vs recorded (same/extra/missed), by criticality"]
    for column in columns:
        critical = ", ".join(f"{name} {count}"
                             for name, count in column.shed_by_criticality.items()) or "-"
        extra = []
        if column.fallbacks:
            extra.append(f"{column.fallbacks} on default params (registry named another "
                         f"policy)")
        if column.unbuildable:
            extra.append(f"{column.unbuildable} skipped (policy does not build)")
        lines.append(
            f"{column.policy:<{width}}  {column.decisions:>9}  {column.agreement:>7.1%}  "
            f"{column.picks:>7}  {column.shed:>6}  {column.no_pick:>6}  "
            f"{column.shed_agree}/{column.shed_extra}/{column.shed_missed}, {critical}"
            + "".join(f"; {note}" for note in extra))
    return lines


def _spread(pool: str, columns: list[PolicyReport]) -> list[str]:
    spreads = [column.pools[pool] for column in columns]
    pods = list(spreads[0].picks)
    pod_width = max([len("max/mean"), *(len(pod) for pod in pods)])
    widths = [max(len(column.policy), 8) for column in columns]
    lines = [f"share of picks per pod, pool {pool}:",
             "  " + f"{'pod':<{pod_width}}" + "".join(
                 f"  {column.policy:>{width}}" for column, width in zip(columns, widths,
                                                                       strict=True))]
    for pod in pods:
        lines.append("  " + f"{pod:<{pod_width}}" + "".join(
            f"  {spread.share.get(pod, 0.0):>{width}.1%}"
            for spread, width in zip(spreads, widths, strict=True)))
    lines.append("  " + f"{'max/mean':<{pod_width}}" + "".join(
        f"  {spread.max_over_mean:>{width}.2f}"
        for spread, width in zip(spreads, widths, strict=True)))
    return lines


def _differences(report: WhatIfReport) -> list[str]:
    if report.decisions == 0:
        return ["no decision records to compare: none in this file"
                + (f" for pool {report.pool}" if report.pool else "")
                + " (pickers publish them on <prefix>.records.<pool>; docs/recording.md)"]
    if not report.differences:
        return ["no decision differs from the recorded one" if report.top else
                "(--top 0: differing decisions not listed)"]
    lines = [f"the {len(report.differences)} decisions the choices differ most on (load gap: "
             "waiting + running + in flight of the most minus the least loaded pod chosen; "
             "shed/no pod first):"]
    for difference in report.differences:
        lines.append(_difference(difference))
    return lines


def _difference(difference: Difference) -> str:
    choices = "  ".join(
        f"{choice.policy}={_answer(choice.pick, choice.shed, choice.load)}"
        for choice in difference.choices)
    request = difference.request_id or f"seq {difference.seq}"
    return (f"  {format_time(difference.time_ns)} {difference.picker} pool {difference.pool} "
            f"request {request} model {difference.model} {difference.criticality} "
            f"gap {difference.load_gap}: {choices}")


def _answer(pick: str | None, shed: bool, load: int | None) -> str:
    if pick is None:
        return "shed" if shed else "no-pod"
    return f"{pick}({load})" if load is not None else pick

