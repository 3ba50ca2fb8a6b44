"""``lig record``: export a window of the recorded fleet to one file.

Reads the recording streams the collector keeps (``LIG_METRICS``, ``LIG_DECISIONS``,
``LIG_REGISTRY``) and the registry bucket, and writes :mod:`recording.fileformat`: first the
registry as of the window start, then snapshots, decisions and registry changes merged in time
order. Memory stays bounded by the registry's size plus one batch per stream.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

from nats.aio.client import Client
from nats.errors import Error as NatsError

from recording.connection import connect_within
from recording.fileformat import Entry, FileHeader, Kind, Writer
from recording.registry_history import Revision, changes_in, join, revision, state_at
from recording.streams import read_stream
from recording.window import Window, window_from
from shared.errors import ConfigError
from shared.logs import setup_logging
from shared.nats_connection import NatsSettings, add_nats_arguments, settings_from_args
from shared.subjects import Subjects, endpoints_key, escape_token, pool_key

log = logging.getLogger("lig.record")



def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``lig record``'s flags."""
    parser.add_argument("--out", required=True, metavar="FILE", default=argparse.SUPPRESS,
                        help="file to write (format: docs/recording.md); written aside and "
                             "renamed when complete")
    parser.add_argument("--since", default=argparse.SUPPRESS, metavar="DURATION",
                        help="export the last DURATION (90s, 10m, 1h); without --from: 10m")
    parser.add_argument("--from", dest="start", default=argparse.SUPPRESS, metavar="T",
                        help="window start: ISO 8601 (UTC unless a zone is given) or unix "
                             "seconds")
    parser.add_argument("--to", dest="end", default=argparse.SUPPRESS, metavar="T",
                        help="window end (without it: now)")
    parser.add_argument("--pool", default=argparse.SUPPRESS,
                        help="export only this pool (without it: every pool)")
    add_nats_arguments(parser)
    parser.add_argument("--log-level", default="WARNING",
                        help="logging level")


def run(args: argparse.Namespace) -> int:
    """Export; exit 0 with a one-line summary, 1 when NATS fails; :class:`ConfigError` (exit 2)
    on bad flags."""
    setup_logging("record", args.log_level)
    # The connection's own reconnect chatter (a disconnect on close) is not for this tool.
    logging.getLogger("lig.nats").setLevel(logging.ERROR)
    try:
        window = window_from(getattr(args, "since", None), getattr(args, "start", None),
                             getattr(args, "end", None), time.time_ns())
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    # Written aside and renamed at the end: a failed export leaves no partial file behind.
    partial = Path(f"{args.out}.partial")
    try:
        with partial.open("wb") as out:
            counts = asyncio.run(export(settings_from_args(args), window, out,
                                        getattr(args, "pool", None)))
        partial.replace(args.out)
    except (NatsError, TimeoutError, OSError) as exc:
        print(f"lig record: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        partial.unlink(missing_ok=True)
    summary = ", ".join(f"{count} {kind}" for kind, count in counts.items()) or "nothing"
    print(f"lig record: wrote {args.out}: {summary}")
    return 0


def _in_pool(key: str, pool: str | None) -> bool:
    if pool is None:
        return True
    return key in (pool_key(pool), endpoints_key(pool)) or \
        key.startswith(f"model.{escape_token(pool)}.")


async def registry_revisions(nc: Client, subjects: Subjects, to_ns: int, pool: str | None
                             ) -> list[Revision]:
    """Every known registry revision up to ``to_ns`` (bucket first, then the recording)."""
    js = nc.jetstream()
    bucket = subjects.registry_bucket
    found: list[Revision] = []
    for stream, sourced in ((f"KV_{bucket}", False), (subjects.registry_stream, True)):
        async for message in read_stream(js, stream, f"$KV.{bucket}.>", None, to_ns):
            item = revision(message, bucket, sourced)
            if item is not None and _in_pool(item.key, pool):
                found.append(item)
    return join(found)


async def _relative(nc: Client, stream: str, subject: str, subjects: Subjects, window: Window,
                    kind: Kind) -> AsyncIterator[tuple[int, int, Kind, Entry]]:
    skip = len(subjects.prefix) + 1
    async for message in read_stream(nc.jetstream(), stream, subject, window.from_ns,
                                     window.to_ns):
        yield message.time_ns, message.seq, kind, Entry(message.time_ns, message.subject[skip:],
                                                        message.data)


async def _listed(changes: list[Revision]) -> AsyncIterator[tuple[int, int, Kind, Entry]]:
    for item in changes:
        yield item.time_ns, item.bucket_seq, Kind.REGISTRY_CHANGE, \
            Entry(item.time_ns, item.key, item.data)


async def merged(*sources: AsyncIterator[tuple[int, int, Kind, Entry]]
                 ) -> AsyncIterator[tuple[Kind, Entry]]:
    """The entries of time-ordered ``sources`` in one time order (ties: source order)."""
    heads: list[tuple[int, int, int, Kind, Entry]] = []

    async def advance(index: int) -> None:
        head = await anext(sources[index], None)
        if head is not None:
            time_ns, seq, kind, entry = head
            heapq.heappush(heads, (time_ns, index, seq, kind, entry))

    for index in range(len(sources)):
        await advance(index)
    while heads:
        _, index, _, kind, entry = heapq.heappop(heads)
        yield kind, entry
        await advance(index)


def recorded_decisions(subjects: Subjects, pool: str | None) -> str:
    """The subjects to export from the decision recording: the decision stream's and the
    decision records' (``<prefix>.decisions.<pool>``, ``<prefix>.records.<pool>``) of ``pool``,
    or of every pool. The stream holds nothing else, so one filter takes both, in stored
    order."""
    return f"{subjects.prefix}.*.{escape_token(pool) if pool else '*'}"


async def export(settings: NatsSettings, window: Window, out: BinaryIO, pool: str | None
                 ) -> dict[str, int]:
    """Write the window to ``out``; returns the number of entries of each kind."""
    subjects = Subjects(settings.prefix)
    nc = await connect_within(settings, "lig-record")
    try:
        revisions = await registry_revisions(nc, subjects, window.to_ns, pool)
        changes = sorted(changes_in(revisions, window.from_ns, window.to_ns),
                         key=lambda item: (item.time_ns, item.bucket_seq))
        metrics = subjects.pool_metrics(pool) if pool else subjects.all_metrics()
        decisions = recorded_decisions(subjects, pool)
        writer = Writer(out, FileHeader(time.time_ns(), window.from_ns, window.to_ns,
                                        subjects.prefix, pool, socket.gethostname()))
        for item in state_at(revisions, window.from_ns):
            writer.add(Kind.REGISTRY_STATE, Entry(item.time_ns, item.key, item.data))
        async for kind, entry in merged(
            _relative(nc, subjects.metrics_stream, metrics, subjects, window, Kind.SNAPSHOT),
            _relative(nc, subjects.decisions_stream, decisions, subjects, window, Kind.DECISION),
            _listed(changes),
        ):
            writer.add(kind, entry)
        writer.close()
        return writer.counts
    finally:
        await nc.close()
