"""``lig bench``: compare scheduling policies on a simulated vLLM fleet in virtual time.

Two modes:

- a sweep you choose: ``--workload``, ``--policies``, ``--rates`` and the fleet flags; writes
  ``results.json``, ``results.md`` and ``<workload>.png`` to ``--out`` and prints the table;
- ``--sweep default``: the sweep of ``docs/benchmarks.md``; rewrites that document's numbers and
  plots in place (``--doc``).

``--trace-from-recording FILE`` makes the first mode play the arrivals of a flight recording
(``lig record``) instead of a workload preset: by default at the recorded rate, on as many pods
as the recorded pool had (``scheduling_bench/recorded_trace.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
from pathlib import Path

import msgspec

from scheduling import build_policy, policy_names
from scheduling_bench import default_sweep, report
from scheduling_bench.fleet import DEFAULT_KV_EVENT_DELAY
from scheduling_bench.recorded_trace import (
    DEFAULT_OUTPUT_TOKENS,
    RecordedTrace,
    describe,
    read_recorded_trace,
)
from scheduling_bench.runner import (
    DEFAULT_POLICY,
    NO_PREFIX_SUFFIX,
    ORACLE_SUFFIX,
    PRECISE_SUFFIX,
    RAW_SUFFIX,
    Point,
    parse_policy,
    run_points,
)
from scheduling_bench.workloads import WORKLOADS, Workload, read_trace
from shared.errors import ConfigError, LigError
from simulator.profiles import DEFAULT_PROFILE, load_profile

TRACE_HELP = (
    "trace CSV with columns arrived_at,num_prefill_tokens,num_decode_tokens (the public Azure "
    "LLM inference trace 2023 as processed by microsoft/vidur, data/processed_traces/"
    "splitwise_conv.csv) or the raw Azure columns TIMESTAMP,ContextTokens,GeneratedTokens"
)

# Flags that override a field of the chosen workload preset.
_WORKLOAD_FLAGS: dict[str, tuple[type, str]] = {
    "burstiness": (float, "Gamma shape of inter-arrival times (1 = Poisson, < 1 burstier)"),
    "adapters": (int, "LoRA adapters, Zipf-popular (0 = base model only)"),
    "zipf": (float, "Zipf exponent of adapter popularity"),
    "max_loras": (int, "GPU adapter slots per pod"),
    "max_cpu_loras": (int, "CPU adapter cache per pod (default: one per adapter)"),
    "prefix_groups": (int, "groups sharing a system prompt"),
    "prefix_tokens": (int, "tokens of each shared system prompt"),
    "critical_fraction": (float, "share of Critical requests"),
    "sheddable_fraction": (float, "share of Sheddable requests"),
}
# Of those, the ones a recording's arrivals leave no room for.
_SYNTHETIC_FLAGS = ("burstiness", "adapters", "zipf", "prefix_groups", "prefix_tokens",
                    "critical_fraction", "sheddable_fraction")
DEFAULT_WORKLOAD = "chat"
DEFAULT_RATES = "100,200,300"
DEFAULT_DURATION = 120.0
DEFAULT_PODS = 8


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``lig bench``."""
    parser.add_argument(
        "--sweep",
        choices=["default", "prefix-sources"],
        help="'default': run the default sweep and rewrite --doc's numbers and plots (needs "
        "--trace); 'prefix-sources': run only its comparison of prefix sources (none, "
        "approximate, precise) and rewrite those tables",
    )
    parser.add_argument(
        "--doc", type=Path, default=Path("docs/benchmarks.md"), help="document --sweep rewrites"
    )
    parser.add_argument(
        "--workload",
        choices=list(WORKLOADS),
        default=argparse.SUPPRESS,  # absent unless given: a recording takes no preset
        help=f"workload preset (default: {DEFAULT_WORKLOAD})",
    )
    parser.add_argument(
        "--trace-from-recording",
        metavar="FILE",
        help="play the arrivals of a flight recording (lig record) instead of a preset: each "
        "recorded decision of the pool arrives at its recorded time (rescaled by --rates; "
        "default: the recorded rate) with its target model, criticality, prompt tokens (usage, "
        "else the picker's estimate) and output tokens (usage, else max_tokens, else "
        f"{DEFAULT_OUTPUT_TOKENS}); prompts play as unique text (recorded prefix sharing is "
        "not reproduced)",
    )
    parser.add_argument(
        "--pool",
        default=argparse.SUPPRESS,
        help="with --trace-from-recording: the recorded pool to play (default: the only pool "
        "with decision records)",
    )
    parser.add_argument(
        "--policies",
        default=",".join(default_sweep.POLICIES),
        help=f"comma-separated policy names (known: {', '.join(policy_names())}); "
        f"'{DEFAULT_POLICY}' is the policy lig picker runs by default; a name ending in "
        f"{RAW_SUFFIX} runs without the pickers' load estimate, on the scraped metrics alone "
        f"(lig picker --no-load-estimate, as upstream); one ending in {ORACLE_SUFFIX} decides "
        "on every pod's exact state at decision time (no scrape delay, no KV-event delay): the "
        f"bound no real picker can beat; one ending in {PRECISE_SUFFIX} takes prefix matches "
        "from the pods' KV-cache events (the precise prefix index; needs --token-ids), one "
        f"ending in {NO_PREFIX_SUFFIX} runs without a prefix index",
    )
    parser.add_argument(
        "--token-ids",
        action="store_true",
        help="clients send completion prompts as token ids (the engines compute on the same "
        "ids, so their KV-cache events carry them), instead of the workload's chat or text "
        f"prompts: what {PRECISE_SUFFIX} needs",
    )
    parser.add_argument(
        "--kv-event-delay",
        type=float,
        default=DEFAULT_KV_EVENT_DELAY,
        help="seconds from the engine step that cached or evicted blocks until the pickers' "
        f"precise prefix index has the event ({PRECISE_SUFFIX}; lig sim -> lig kv-events -> "
        "NATS -> picker)",
    )
    # The next three are absent unless given: their defaults depend on --trace-from-recording.
    parser.add_argument(
        "--rates",
        default=argparse.SUPPRESS,
        help=f"comma-separated requests/s (default: {DEFAULT_RATES}; with "
        "--trace-from-recording: the recorded rate, other rates scale its arrival times)",
    )
    parser.add_argument(
        "--pods",
        type=int,
        default=argparse.SUPPRESS,
        help=f"simulated vLLM pods (default: {DEFAULT_PODS}; with --trace-from-recording: as "
        "many as the recorded pool's endpoints)",
    )
    parser.add_argument("--pickers", type=int, default=1, help="picker replicas")
    parser.add_argument(
        "--decision-delay",
        type=float,
        default=0.002,
        help="seconds until a picker replica's decisions reach the other replicas (the "
        "decision stream's batching and NATS hop)",
    )
    parser.add_argument(
        "--no-shared-decisions",
        dest="shared_decisions",
        action="store_false",
        help="replicas do not share decisions, each counts only its own requests "
        "(lig picker --no-shared-decisions)",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=argparse.SUPPRESS,
        help=f"seconds of arrivals (default: {DEFAULT_DURATION:g}; with --trace-from-recording: "
        "all recorded arrivals)",
    )
    parser.add_argument("--seed", type=int, default=1, help="seeds every random stream")
    parser.add_argument(
        "--out", type=Path, default=Path("bench-results"), help="folder for results and plot"
    )
    parser.add_argument("--trace", help=TRACE_HELP)
    parser.add_argument("--scrape-interval", type=float, default=0.05, help="seconds")
    parser.add_argument(
        "--propagation-delay", type=float, default=0.005, help="scrape to picker, seconds"
    )
    parser.add_argument(
        "--profile", default=DEFAULT_PROFILE, help="simulator profile name or YAML/JSON file"
    )
    parser.add_argument(
        "--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes"
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG (no matplotlib)")
    for field, (kind, text) in _WORKLOAD_FLAGS.items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=kind, help=text)


def run(args: argparse.Namespace) -> int:
    """Run the sweep the flags describe; 0 on success. Raises :class:`ConfigError` or
    :class:`InputError` (:mod:`shared.errors`; exit 2) on bad flags or input files."""
    try:
        if args.sweep == "default":
            return _run_default_sweep(args)
        if args.sweep == "prefix-sources":
            return _run_prefix_sources(args)
        return _run_sweep(args)
    except LigError:
        raise
    except ValueError as error:  # the parsers the flag values go through raise ValueError
        raise ConfigError(str(error)) from None


def _run_default_sweep(args: argparse.Namespace) -> int:
    if not args.trace:
        raise ConfigError(f"--sweep default replays a trace: pass --trace PATH ({TRACE_HELP})")
    if args.trace_from_recording:
        raise ConfigError("--sweep default runs its own workloads: no --trace-from-recording")
    if not args.doc.is_file():
        raise ConfigError(f"{args.doc}: no such document")
    _require_matplotlib()
    read_trace(args.trace)  # a bad trace fails here, before the sweep starts
    command = ["lig", "bench", "--sweep", "default", "--trace", "PATH/TO/splitwise_conv.csv"]
    default_sweep.regenerate(args.doc, args.trace, command, args.jobs)
    print(f"rewrote {args.doc} and its plots in {args.doc.parent / args.doc.stem}/")
    return 0


def _run_prefix_sources(args: argparse.Namespace) -> int:
    if not args.doc.is_file():
        raise ConfigError(f"{args.doc}: no such document")
    default_sweep.regenerate_prefix_sources(args.doc, args.jobs)
    print(f"rewrote the prefix-source tables of {args.doc}")
    return 0


def _run_sweep(args: argparse.Namespace) -> int:
    recorded = _recorded_trace(args) if args.trace_from_recording else None
    if hasattr(args, "pool") and recorded is None:
        raise ConfigError("--pool names a recorded pool: use it with --trace-from-recording")
    workload = _workload(args) if recorded is None else _recorded_workload(args, recorded)
    labels = [name.strip() for name in args.policies.split(",") if name.strip()]
    choices = [parse_policy(label) for label in labels]
    for choice in choices:  # fail on a bad name before any run starts
        build_policy(choice.policy, random.Random(0))
    if any(choice.prefix == "precise" for choice in choices) and not workload.token_ids:
        raise ConfigError(f"{PRECISE_SUFFIX} needs prompts of token ids: pass --token-ids")
    given_rates: str | None = getattr(args, "rates", None)
    if given_rates is not None:
        rates = _numbers(given_rates, "--rates")
    else:
        rates = [recorded.rate] if recorded else _numbers(DEFAULT_RATES, "--rates")
    if hasattr(args, "pods"):
        pods: int = args.pods
    else:  # a recording without endpoints or views of pods gets the usual fleet
        pods = (recorded.pods if recorded else 0) or DEFAULT_PODS
    duration: float | None = getattr(args, "duration", None)
    if pods < 1 or args.pickers < 1 or args.jobs < 1 or (duration is not None and duration <= 0):
        raise ConfigError("--pods, --pickers and --jobs must be >= 1 and --duration > 0")
    if args.decision_delay < 0:
        raise ConfigError("--decision-delay must be >= 0")
    if args.kv_event_delay < 0:
        raise ConfigError("--kv-event-delay must be >= 0")
    profile = load_profile(args.profile)
    if not args.no_plots:
        _require_matplotlib()
    points = [
        Point(
            workload=workload,
            **choice.fields(),
            shared_decisions=args.shared_decisions,
            decision_delay=args.decision_delay,
            kv_event_delay=args.kv_event_delay,
            rate=rate,
            duration=_duration(duration, recorded, rate),
            seed=args.seed,
            pods=pods,
            pickers=args.pickers,
            scrape_interval=args.scrape_interval,
            propagation_delay=args.propagation_delay,
            profile=profile,
        )
        for rate in rates
        for choice in choices
    ]
    results = run_points(points, jobs=args.jobs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_bytes(msgspec.json.format(msgspec.json.encode(results)))
    table = report.markdown_table(results)
    if report.has_mixed_criticality(results):
        table += "\n" + report.criticality_table(results)
    if recorded is not None:
        table = describe(recorded) + "\n\n" + table
    (args.out / "results.md").write_text(table)
    written = [args.out / "results.json", args.out / "results.md"]
    if not args.no_plots:
        image = args.out / f"{workload.name}.png"
        title = f"{workload.name}: {pods} pods, {args.pickers} picker(s), {profile.name}"
        report.plot(results, title, image)
        written.append(image)
    print(table)
    print("wrote " + ", ".join(str(path) for path in written))
    return 0


def _require_matplotlib() -> None:
    """Fail before a long sweep, not after it, when the plots cannot be drawn."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("plots need matplotlib: pip install -e '.[bench]', or pass --no-plots")


def _recorded_trace(args: argparse.Namespace) -> RecordedTrace:
    """The recording's trace, after checking no flag asks for what a recording fixes."""
    given = [f"--{field.replace('_', '-')}" for field in _SYNTHETIC_FLAGS
             if getattr(args, field) is not None]
    if hasattr(args, "workload") or args.trace:
        given.insert(0, "--workload" if hasattr(args, "workload") else "--trace")
    if given:
        raise ConfigError(f"--trace-from-recording plays the recorded requests: {', '.join(given)} "
                         "cannot apply")
    return read_recorded_trace(args.trace_from_recording, getattr(args, "pool", None))


def _recorded_workload(args: argparse.Namespace, trace: RecordedTrace) -> Workload:
    """The workload playing ``trace``: its adapters, and the recorded pods' adapter slots unless
    ``--max-loras`` says otherwise."""
    slots = args.max_loras if args.max_loras is not None else trace.max_lora
    workload = Workload(
        name="recording",
        description=f"the arrivals of pool {trace.pool} recorded in {trace.path}",
        recording=str(Path(trace.path).resolve()),
        recording_pool=trace.pool,
        adapters=len(trace.adapters),
        max_cpu_loras=args.max_cpu_loras,
    )
    if slots:
        workload = msgspec.structs.replace(workload, max_loras=slots)
    return workload.validate()


def _duration(given: float | None, trace: RecordedTrace | None, rate: float) -> float:
    """``--duration`` (``given``), else every recorded arrival at ``rate`` (one mean gap past the
    last), else the default."""
    if given is not None:
        return given
    if trace is not None:
        return len(trace.arrivals) / rate
    return DEFAULT_DURATION


def _workload(args: argparse.Namespace) -> Workload:
    name = getattr(args, "workload", DEFAULT_WORKLOAD)
    workload = WORKLOADS[name]
    overrides = {
        field: getattr(args, field) for field in _WORKLOAD_FLAGS if getattr(args, field) is not None
    }
    if args.token_ids:
        overrides.update(token_ids=True, chat=False)
    if args.trace:
        read_trace(args.trace)  # a bad trace fails here, before any run starts
        overrides["trace"] = args.trace
    elif name == "trace":
        raise ConfigError(f"--workload trace needs --trace PATH ({TRACE_HELP})")
    return msgspec.structs.replace(workload, **overrides).validate()


def _numbers(text: str, flag: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise ConfigError(f"{flag}: expected positive numbers, got {text!r}")
    return values
