"""``python -m resilience {attack,chaos,soak}``: see docs/resilience.md.

Each prints a table of figures and exits 0 when every target is met, 1 when one is missed, 2 on
bad usage or a stack that does not start.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import msgspec

from resilience import attack, chaos, soak
from resilience.report import Figure, all_passed, table
from resilience.stack import Picker, attach, own_stack
from shared.logs import setup_logging

EXIT_MISSED = 1
EXIT_BAD_USAGE = 2


def _stack_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("the stack (default: start one on free loopback ports)")
    group.add_argument("--pods", type=int, default=4, help="simulated pods of a started stack")
    group.add_argument("--pickers", type=int, default=2, help="pickers of a started stack")
    group.add_argument("--sim-args", default="", metavar="ARGS",
                       help="more `lig sim` flags for a started stack's pods, in one string")
    group.add_argument("--ready-timeout", type=float, default=60.0,
                       help="seconds a started stack may take to become ready")
    group.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                       help="keep a started stack's state here (its services' logs in "
                            "DIR/logs, to read after the run); default: a temporary folder, "
                            "removed at the end")


def _csv(choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(name.strip() for name in text.split(",") if name.strip())
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown) or '(none)'}; choose from {', '.join(choices)}")
        return names
    return parse


S = TypeVar("S", bound=msgspec.Struct)

_ATTACK_FLAGS = {
    "duration": "seconds each HTTP/2 scenario lasts",
    "rate": "requests/s through Envoy during the HTTP/2 scenarios",
    "streams": "streams the flood opens on each picker",
    "settings_frames": "SETTINGS frames the flood sends once its streams are open",
    "amplification_frames": "one-byte HEADERS frames of the amplification",
    "amplification_seconds": "seconds the amplification's connection is held (memory watched)",
    "header_frames": "1 MiB HEADERS frames of HPACK table-size updates (buffering)",
    "partial_streams": "streams each sending 8 MiB of a never-completed message (buffering)",
    "control_frames": "frames of each control-frame flood",
    "slow_connections": "silent and half-preface connections (each)",
}
_CHAOS_FLAGS = {
    "rate": "requests/s through Envoy during each fault",
    "before": "seconds of load before each fault",
    "outage": "seconds a killed service stays down before it is started again",
    "pod_stop": "seconds a pod stays stopped (SIGSTOP)",
    "settle": "seconds of load after each recovery",
    "index_check": "seconds after a kill's or pod stop's end when each picker's precise index "
                   "is judged against the block witness (the load runs until then)",
    "streams_in_flight": "rewritten streams picker-streams waits for (at most --before s more) "
                         "before killing picker-0",
    "gray_seconds": "seconds of load with pod 0 gray",
    "gray_warmup": "seconds before the gray pod's share is counted",
    "request_timeout": "seconds a client waits for an answer before counting it lost",
    "response_timeout": "the stack's lig up --response-timeout: seconds Envoy waits for a "
                        "silent pod (the gray pod's held requests) before its 504",
}
_SOAK_FLAGS = {
    "seconds": "seconds of load (the memory target is judged over the last third)",
    "rate": "unique prompts/s through Envoy",
    "prompt_tokens": "tokens of each unique prompt (lig sim's tokenizer: one per word)",
    "request_timeout": "seconds a client waits for an answer before counting it lost",
    "precise_blocks": "each picker's --precise-blocks (the precise index's bound, a pool)",
    "prefix_index_entries": "each picker's --prefix-index-entries (the approximate index's "
                            "bound, a pool)",
}


def _settings_flags(parser: argparse.ArgumentParser, defaults: object,
                    helps: dict[str, str]) -> None:
    """A ``--field-name`` flag per settings field in ``helps``, typed and defaulted by
    ``defaults``."""
    for field, text in helps.items():
        default = getattr(defaults, field)
        parser.add_argument("--" + field.replace("_", "-"), type=type(default), default=default,
                            help=text)


def _settings(settings_type: type[S], args: argparse.Namespace, helps: dict[str, str],
              **fixed: object) -> S:
    """``settings_type`` from the flags of ``helps`` and the ``fixed`` fields (msgspec checks
    every field's type)."""
    return msgspec.convert({**fixed, **{field: getattr(args, field) for field in helps}},
                           settings_type)


def configure_attack(parser: argparse.ArgumentParser) -> None:
    """Flags of ``attack``."""
    defaults = attack.AttackSettings()
    parser.add_argument("--only", type=_csv(attack.SCENARIOS), default=attack.SCENARIOS,
                        metavar="LIST", help="comma-separated scenarios to run: "
                        f"{', '.join(attack.SCENARIOS)} (default: all)")
    _settings_flags(parser, defaults, _ATTACK_FLAGS)
    parser.add_argument("--slow-hold", type=float, default=defaults.slow_hold, metavar="SECONDS",
                        help="seconds each slow connection is held before counting those the "
                        "picker closed (must exceed its preface timeout)")
    attached = parser.add_argument_group("attach to a running stack instead")
    attached.add_argument("--gateway", default=None, metavar="URL",
                          help="Envoy's client URL, e.g. http://127.0.0.1:8081")
    attached.add_argument("--picker", type=int, action="append", default=[], metavar="PORT",
                          help="a picker's ext_proc port on 127.0.0.1 (repeatable; its pid is "
                               "found from the port for memory and CPU figures)")
    _stack_flags(parser)


def configure_chaos(parser: argparse.ArgumentParser) -> None:
    """Flags of ``chaos`` (it always starts its own stack: it kills its services)."""
    parser.add_argument("--faults", type=_csv(chaos.FAULTS), default=chaos.FAULTS,
                        metavar="LIST", help=f"comma-separated faults: {', '.join(chaos.FAULTS)}"
                        " (default: all)")
    _settings_flags(parser, chaos.ChaosSettings(), _CHAOS_FLAGS)
    _stack_flags(parser)
    parser.add_argument("--replay-buffer", type=int, default=chaos.REPLAY_BUFFER,
                        metavar="BATCHES",
                        help="KV-event batches each pod keeps for replays (vLLM's buffer_steps; "
                             "vLLM keeps 10000, minutes of load: a small buffer has rolled over "
                             "when lig kv-events restarts, as in issue 26, within a short run)")


def configure_soak(parser: argparse.ArgumentParser) -> None:
    """Flags of ``soak`` (it starts its own stack: it must know its pickers' bounds)."""
    _settings_flags(parser, soak.SoakSettings(), _SOAK_FLAGS)
    _stack_flags(parser)
    parser.set_defaults(sim_args=soak.SIM_ARGS)


def _print(figures: list[Figure]) -> int:
    print(table(figures), flush=True)
    return 0 if all_passed(figures) else EXIT_MISSED


async def _attack(args: argparse.Namespace) -> int:
    settings = _settings(attack.AttackSettings, args, _ATTACK_FLAGS, scenarios=args.only,
                         slow_hold=args.slow_hold)
    if args.gateway is not None:
        target = attach(args.gateway, args.picker, [])
        return _print(await attack.run_attacks(lambda: target, settings))
    async with own_stack(args.pods, args.pickers, args.sim_args, args.ready_timeout,
                         state_dir=args.state_dir) as stack:

        async def recover(picker: Picker) -> None:
            stack.kill(picker.name)
            stack.restart(picker.name)
            await stack.wait_ready(args.ready_timeout)

        figures = await attack.run_attacks(lambda: stack.target, settings, recover)
        died = stack.unexpected_exit()
        if died is not None:
            figures.append(Figure("stack", "no service died", died.splitlines()[0], "none",
                                  False))
        return _print(figures)


async def _chaos(args: argparse.Namespace) -> int:
    settings = _settings(chaos.ChaosSettings, args, _CHAOS_FLAGS, faults=args.faults,
                         ready_timeout=args.ready_timeout)
    async with own_stack(args.pods, args.pickers, args.sim_args, args.ready_timeout,
                         response_timeout=settings.response_timeout, witness=True,
                         replay_buffer=args.replay_buffer, state_dir=args.state_dir) as stack:
        return _print(await chaos.run_chaos(stack, settings))


async def _soak(args: argparse.Namespace) -> int:
    settings = _settings(soak.SoakSettings, args, _SOAK_FLAGS)
    async with own_stack(args.pods, args.pickers, args.sim_args, args.ready_timeout,
                         picker_args=settings.picker_args(), state_dir=args.state_dir) as stack:
        return _print(await soak.run_soak(stack, settings))


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen tool."""
    parser = argparse.ArgumentParser(
        prog="python -m resilience",
        description="bounded attack, chaos and soak runs against a gateway stack on loopback; "
                    "each prints its figures with PASS/MISS per target (docs/resilience.md)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    tools = parser.add_subparsers(dest="tool", required=True)
    configure_attack(tools.add_parser(
        "attack", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="HTTP/2 floods, amplification, slow peers and control-frame floods on the pickers, "
             "bad HTTP through Envoy, under client traffic"))
    configure_chaos(tools.add_parser(
        "chaos", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="kill NATS, collector, a picker, the registry, lig kv-events, a picker with "
             "rewritten streams in flight; stop a pod; turn a pod gray; all under load through "
             "Envoy, counting lost requests and judging the pickers' precise indexes against a "
             "witness of the pods' true block sets"))
    configure_soak(tools.add_parser(
        "soak", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="unique long prompts through Envoy for minutes, sampling every picker's memory "
             "every second: it must stay flat over the last third while both prefix indexes "
             "fill to their bounds"))
    args = parser.parse_args(argv)
    if args.tool == "attack" and args.gateway is not None and not args.picker:
        parser.error("--gateway needs at least one --picker PORT")
    if args.rate <= 0 or getattr(args, "duration", 1) <= 0:
        parser.error("--rate and --duration must be above 0")
    if getattr(args, "replay_buffer", 1) < 1:
        parser.error("--replay-buffer must be at least 1")
    if getattr(args, "seconds", 1) <= 0:
        parser.error("--seconds must be above 0")
    if getattr(args, "prompt_tokens", soak.MIN_PROMPT_TOKENS) < soak.MIN_PROMPT_TOKENS:
        parser.error(f"--prompt-tokens must be at least {soak.MIN_PROMPT_TOKENS} (a KV block)")
    # As in lig up: the readiness checks' NATS client would log its reconnects and closes.
    setup_logging("resilience", "ERROR")
    try:
        tool = {"attack": _attack, "chaos": _chaos, "soak": _soak}[args.tool]
        return asyncio.run(tool(args))
    except RuntimeError as exc:  # the stack did not start
        print(f"resilience: {exc}", file=sys.stderr)
        return EXIT_BAD_USAGE


if __name__ == "__main__":
    sys.exit(main())
