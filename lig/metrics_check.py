"""``lig metrics parse SOURCE``: show what the gateway reads from a model server's ``/metrics``.

Operators run it against a server before adding it to a pool: it prints the fields the collector
would publish (queues, KV-cache usage, LoRA state, cache config) and which vLLM families were
found or missing. SOURCE is a file or an ``http://`` URL; ``--json`` prints one object with the
fields under DESIGN.md's names (null where absent) and ``missing``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import msgspec

from shared.errors import InputError
from shared.vllm_metrics import (
    FAMILIES,
    MetricsParseError,
    ParsedMetrics,
    parse_vllm_metrics,
    present_families,
)


class SourceError(InputError):
    """The page could not be read from the file or URL."""


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``parse`` action and its flags."""
    actions = parser.add_subparsers(dest="action", required=True)
    parse = actions.add_parser(
        "parse",
        help="read one /metrics page and show what the gateway reads from it",
        description="Read one /metrics page and show what the gateway reads from it. "
        "Exit code 2 when the source cannot be read or the page cannot be parsed.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parse.add_argument("source", metavar="SOURCE", help="a file path or an http:// URL")
    parse.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a table"
    )
    parse.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for an http:// source"
    )


def run(args: argparse.Namespace) -> int:
    """Read, parse and print; :class:`InputError` (exit 2) when the page cannot be read or
    parsed."""
    try:
        page = read_source(args.source, args.timeout)
        metrics = parse_vllm_metrics(page)
    except (SourceError, MetricsParseError) as exc:
        raise InputError(f"{args.source}: {_one_line(str(exc))}") from None
    if args.json:
        print(json.dumps(msgspec.to_builtins(metrics)))
    else:
        print(format_report(args.source, metrics, present_families(page)))
    return 0


def read_source(source: str, timeout: float) -> bytes:
    """The bytes of a file, or the body of a successful GET of an http(s) URL."""
    if source.startswith(("http://", "https://")):
        try:
            response = httpx.get(source, timeout=timeout, follow_redirects=True)
        except httpx.HTTPError as exc:
            raise SourceError(f"cannot fetch: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise SourceError(f"HTTP {response.status_code} {response.reason_phrase}")
        return response.content
    try:
        return Path(source).read_bytes()
    except OSError as exc:
        raise SourceError(f"cannot read: {exc.strerror or exc}") from exc


def format_report(source: str, metrics: ParsedMetrics, found: tuple[str, ...]) -> str:
    """A table of the fields, then the families found and missing."""
    rows = [
        ("waiting", metrics.waiting),
        ("running", metrics.running),
        ("kv_cache_usage", metrics.kv_cache_usage),
        ("running_adapters", metrics.running_adapters),
        ("waiting_adapters", metrics.waiting_adapters),
        ("max_lora", metrics.max_lora),
        ("block_size", metrics.block_size),
        ("num_gpu_blocks", metrics.num_gpu_blocks),
    ]
    lines = [f"what the gateway reads from {source}:"]
    lines += [f"  {name:<18} {_show(value)}" for name, value in rows]
    lines.append(f"families found:   {', '.join(f for f in FAMILIES if f in found) or '(none)'}")
    lines.append(f"families missing: {', '.join(metrics.missing) or '(none)'}")
    return "\n".join(lines)


def _show(value: object) -> str:
    if value is None:
        return "absent"
    if isinstance(value, tuple):
        return ", ".join(value) if value else "(none)"  # an empty adapter list is a real state
    return str(value)


def _one_line(text: str) -> str:
    return " ".join(text.split())
