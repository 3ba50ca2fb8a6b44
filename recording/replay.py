"""``lig replay FILE``: publish a recording onto a NATS as if the fleet were live.

The registry state is written into the bucket at once; snapshots and registry changes follow
with their recorded spacing divided by ``--speed``, every snapshot's scrape time shifted by
(now - window start) so a picker or ``lig status`` sees fresh pods. Decisions are not
published: a live picker would count them as a peer's load. The file is streamed (bounded
memory); SIGTERM stops at once. ``--what-if`` compares policies on the recorded decisions
offline instead (:mod:`recording.whatif_cli`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
from typing import BinaryIO

import msgspec
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js.api import KeyValueConfig
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from recording import whatif_cli
from recording.connection import connect_within
from recording.fileformat import Entry, FileHeader, Kind, RecordingError, read_entries, read_header
from shared.logs import setup_logging
from shared.nats_connection import NatsSettings, add_nats_arguments, settings_from_args
from shared.schemas import DecodeError, PodMetrics, decode, encode
from shared.service import cancel_and_wait, run_service
from shared.subjects import Subjects
from shared.waits import wait_set, within

log = logging.getLogger("lig.replay")

BUCKET_HISTORY = 5  # as the registry creates it
FLUSH_EVERY = 512  # snapshots published between flushes when replaying faster than recorded


class ReplayCounts(msgspec.Struct):
    """What a replay published."""

    snapshots: int = 0
    registry: int = 0
    undecodable: int = 0  # snapshots published unshifted: not a PodMetrics this lig reads
    skipped: int = 0  # decisions (never published)


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``lig replay``'s flags; ``--prefix`` (in the NATS group) is where to publish."""
    parser.add_argument("file", help="a recording written by 'lig record'")
    parser.add_argument("--speed", type=float, default=1.0,
                        help="replay X times faster than recorded (0.5: half as fast)")
    add_nats_arguments(parser)
    parser.add_argument("--log-level", default="WARNING", help="logging level")
    whatif_cli.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Replay until the file ends or SIGTERM/SIGINT; 2 for a bad file or flags, 1 when NATS
    fails."""
    setup_logging("replay", args.log_level)
    # The connection's own reconnect chatter (a disconnect on close) is not for this tool.
    logging.getLogger("lig.nats").setLevel(logging.ERROR)
    if not args.speed > 0:
        print("lig replay: --speed must be > 0", file=sys.stderr)
        return 2
    if not args.what_if and (flag := whatif_cli.misused(args)):
        print(f"lig replay: {flag} needs --what-if", file=sys.stderr)
        return 2
    try:
        source = open(args.file, "rb")  # noqa: SIM115 - closed below, after the replay
    except OSError as exc:
        print(f"lig replay: {exc}", file=sys.stderr)
        return 2
    with source:
        try:
            header = read_header(source)
        except RecordingError as exc:
            print(f"lig replay: {args.file}: {exc}", file=sys.stderr)
            return 2
        if args.what_if:
            return whatif_cli.run(args, source, header)
        settings = settings_from_args(args)
        return run_service(lambda stop: _replay_and_report(settings, header, source, args.speed,
                                                           args.file, stop))


async def _replay_and_report(settings: NatsSettings, header: FileHeader, source: BinaryIO,
                             speed: float, name: str, stop: asyncio.Event) -> int:
    connecting = asyncio.ensure_future(connect_within(settings, "lig-replay"))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not connecting.done():  # SIGTERM while still connecting
        await cancel_and_wait(connecting)
        print("lig replay: stopped before NATS answered")
        return 0
    try:
        nc = connecting.result()
    except (NatsError, OSError) as exc:
        print(f"lig replay: {exc}", file=sys.stderr)
        return 1
    counts = ReplayCounts()
    try:
        await Replay(nc, Subjects(settings.prefix), header, speed, counts).run(source, stop)
    except RecordingError as exc:
        print(f"lig replay: {name}: {exc}", file=sys.stderr)
        return 2
    except (NatsError, TimeoutError) as exc:
        print(f"lig replay: NATS failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(NatsError, TimeoutError):
            await within(nc.drain(), 2.0)
    state = "stopped" if stop.is_set() else "done"
    print(f"lig replay: {state}: {counts.snapshots} snapshots, {counts.registry} registry "
          f"writes ({counts.undecodable} snapshots unshifted, {counts.skipped} decisions not "
          f"published)")
    return 0


def shifted(data: bytes, shift_ns: int) -> bytes | None:
    """A snapshot with its scrape time moved by ``shift_ns``; None if it is not a PodMetrics."""
    try:
        snapshot = decode(data, PodMetrics)
    except DecodeError:
        return None
    return encode(msgspec.structs.replace(snapshot,
                                          scrape_time_ns=snapshot.scrape_time_ns + shift_ns))


class Replay:
    """One pass over a recording onto ``nc`` under ``subjects``."""

    def __init__(self, nc: Client, subjects: Subjects, header: FileHeader, speed: float,
                 counts: ReplayCounts) -> None:
        self.nc = nc
        self.subjects = subjects
        self.header = header
        self.speed = speed
        self.counts = counts
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            js = self.nc.jetstream()
            try:
                self._kv = await js.key_value(self.subjects.registry_bucket)
            except NotFoundError:
                self._kv = await js.create_key_value(KeyValueConfig(
                    bucket=self.subjects.registry_bucket, history=BUCKET_HISTORY,
                    description="lig: pools, models, endpoints (replayed)"))
        return self._kv

    async def _write_registry(self, entry: Entry) -> None:
        kv = await self._bucket()
        if entry.data is None:
            with contextlib.suppress(NotFoundError):
                await kv.delete(entry.name)
        else:
            await kv.put(entry.name, entry.data)
        self.counts.registry += 1

    async def run(self, source: BinaryIO, stop: asyncio.Event) -> None:
        """Publish every entry at its (shifted, scaled) time until the file ends or ``stop``."""
        loop = asyncio.get_running_loop()
        start_mono = loop.time()
        shift_ns = time.time_ns() - self.header.from_ns
        since_flush = 0
        for kind, entry in read_entries(source):
            if stop.is_set():
                return
            if kind == Kind.REGISTRY_STATE:
                await self._write_registry(entry)
                continue
            if kind == Kind.DECISION:
                self.counts.skipped += 1
                continue
            due = start_mono + (entry.time_ns - self.header.from_ns) / 1e9 / self.speed
            delay = due - loop.time()
            if delay > 0:
                await self.nc.flush()
                since_flush = 0
                if await wait_set(stop, delay):
                    return
            if kind == Kind.REGISTRY_CHANGE:
                await self._write_registry(entry)
            elif kind == Kind.SNAPSHOT:
                data = shifted(entry.data or b"", shift_ns)
                if data is None:
                    self.counts.undecodable += 1
                await self.nc.publish(f"{self.subjects.prefix}.{entry.name}",
                                      data if data is not None else entry.data or b"")
                self.counts.snapshots += 1
                since_flush += 1
                if since_flush >= FLUSH_EVERY:
                    await self.nc.flush()
                    since_flush = 0
        await self.nc.flush()
