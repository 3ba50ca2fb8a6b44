"""``lig <command>``: dispatch to the module that implements each subcommand.

Each command module exposes ``configure(parser)`` to add its flags and ``run(args) -> int``.
Modules are imported only when their command runs, so ``lig sim`` does not pay for gRPC imports.
This is where the project's errors (:class:`shared.errors.LigError`: a bad flag or input file, a
port in use...) become one line on stderr, ``lig <command>: error: <message>``, and the exit
code the error's class declares, the same for every command.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from shared.errors import ExitCode, LigError

COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("lig.up", "run the whole local stack: NATS, registry, collector, kv-events, "
                     "pickers, Envoy, sims"),
    "status": ("lig.status", "show pods, their latest metrics and freshness, and picker counts"),
    "picker": ("services.picker.main", "serve Envoy ext_proc: pick a pod per request"),
    "collector": ("services.collector.main", "scrape model servers and publish metric snapshots"),
    "kv-events": ("services.kvevents.main",
                  "republish vLLM KV-cache events of every pod as block changes on NATS"),
    "registry": ("services.registry.main", "publish pools, models and endpoints from YAML files"),
    "sim": ("simulator.main", "run simulated vLLM model servers (OpenAI API and vLLM metrics)"),
    "explain": ("lig.explain", "run a scheduling policy on given pods (or a recorded decision) "
                "and show every step"),
    "metrics": ("lig.metrics_check", "show what the gateway reads from a model server's /metrics"),
    "bench": ("scheduling_bench.main", "compare scheduling policies on a simulated fleet"),
    "record": ("recording.export", "export a window of the recorded fleet to one file"),
    "replay": ("recording.replay", "publish a recording onto a NATS as a live fleet, or "
               "compare policies on its decisions (--what-if)"),
    "nats-config": ("lig.nats_config", "write per-service NATS users with least privilege"),
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lig",
        description="llm-instance-gateway: an LLM-aware endpoint picker for vLLM fleets.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n"
        + "\n".join(f"  {name:<10} {summary}" for name, (_, summary) in COMMANDS.items())
        + "\n\nRun 'lig <command> --help' for a command's flags.",
    )
    parser.add_argument("command", choices=COMMANDS, metavar="command", help="see below")
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lig`` console script."""
    top = _top_parser().parse_args(argv if argv is not None else sys.argv[1:])
    module_name, summary = COMMANDS[top.command]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(
        prog=f"lig {top.command}",
        description=summary,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    module.configure(parser)
    args = parser.parse_args(top.args)
    try:
        code = int(module.run(args))
        sys.stdout.flush()  # a reader that went away shows here, not as a traceback at exit
        return code
    except BrokenPipeError:
        # The output's reader stopped reading (``lig ... | head``): end quietly, as shell tools
        # do; what is still buffered goes nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.FAILURE
    except KeyboardInterrupt:  # Ctrl-C in a long command: one line, not a traceback
        print(f"lig {top.command}: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except LigError as error:
        print(f"lig {top.command}: error: {error}", file=sys.stderr)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
