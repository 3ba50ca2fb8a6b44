"""``lig replay FILE``: publish a recording onto a NATS as if the fleet were live.

The registry state is written into the bucket at once; the first snapshot or registry change
follows at once too (the window's empty start, when it began before the fleet was recorded, is
skipped and said so), the others with their recorded spacing divided by ``--speed``. Every
snapshot's scrape time is moved onto the replay's clock the same way (:class:`Timeline`), so a
picker or ``lig status`` sees fresh pods. Decisions are not published: a live picker would count
them as a peer's load. Progress goes to stderr every ``--progress`` seconds. The file is
streamed (bounded memory); SIGTERM stops at once. ``--what-if`` compares policies on the
recorded decisions offline instead (:mod:`recording.whatif_cli`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import threading
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
from recording.replay_progress import Survey, lead_in_line, progress_line, survey
from shared.errors import ConfigError, InputError
from shared.logs import setup_logging
from shared.nats_connection import NatsSettings, add_nats_arguments, settings_from_args
from shared.schemas import DecodeError, PodMetrics, decode, encode
from shared.service import cancel_and_wait, run_service
from shared.subjects import Subjects
from shared.waits import wait_set, within

log = logging.getLogger("lig.replay")

BUCKET_HISTORY = 5  # as the registry creates it
FLUSH_EVERY = 512  # snapshots published between flushes when replaying faster than recorded
PROGRESS_EVERY_S = 5.0  # often enough to see it move, rare enough to read
# A window that starts this much before its first record says so: a live fleet's first snapshot
# follows the window start within a scrape interval, a recording made with a longer --since
# than the fleet had run does not.
LEAD_IN_NOTICE_S = 1.0


class ReplayCounts(msgspec.Struct):
    """What a replay published."""

    snapshots: int = 0
    registry: int = 0
    undecodable: int = 0  # snapshots published unshifted: not a PodMetrics this lig reads
    skipped: int = 0  # decisions (never published)

    def published(self) -> int:
        """Records published so far: registry writes and snapshots."""
        return self.registry + self.snapshots


class Timeline(msgspec.Struct, frozen=True):
    """Recorded time onto the replay's: the first record published at its time (``first_ns``,
    its store time) is due when the replay starts, the others keep their recorded spacing
    divided by ``speed``. Scrape times are mapped the same way, so a snapshot is as old, at the
    moment it is published, as it was when it was recorded (divided by ``speed``)."""

    first_ns: int
    start_mono: float  # the event loop's clock at the start
    start_wall_ns: int  # the wall clock at the start
    speed: float

    def due(self, time_ns: int) -> float:
        """The loop time at which the record stored at ``time_ns`` is published."""
        return self.start_mono + (time_ns - self.first_ns) / 1e9 / self.speed

    def wall_ns(self, time_ns: int) -> int:
        """The replay's wall clock time for the recorded wall clock time ``time_ns``."""
        return self.start_wall_ns + round((time_ns - self.first_ns) / self.speed)

    def position_s(self, mono: float) -> float:
        """Recorded seconds since the first record that the replay has reached at ``mono``."""
        return max(0.0, (mono - self.start_mono) * self.speed)


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``lig replay``'s flags; ``--prefix`` (in the NATS group) is where to publish."""
    parser.add_argument("file", help="a recording written by 'lig record'")
    parser.add_argument("--speed", type=float, default=1.0,
                        help="replay X times faster than recorded (0.5: half as fast)")
    parser.add_argument("--progress", type=float, default=PROGRESS_EVERY_S, metavar="SECONDS",
                        help="print the records published and the position in the recording "
                             "to stderr every SECONDS (0: never; default: %(default)g)")
    add_nats_arguments(parser)
    parser.add_argument("--log-level", default="WARNING", help="logging level")
    whatif_cli.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Replay until the file ends or SIGTERM/SIGINT; 1 when NATS fails. Raises
    :class:`ConfigError` or :class:`InputError` (exit 2) for bad flags or a bad file."""
    setup_logging("replay", args.log_level)
    # The connection's own reconnect chatter (a disconnect on close) is not for this tool.
    logging.getLogger("lig.nats").setLevel(logging.ERROR)
    if not args.speed > 0:
        raise ConfigError("--speed must be > 0")
    if not args.progress >= 0:
        raise ConfigError("--progress must be >= 0 (0: no progress lines)")
    if not args.what_if and (flag := whatif_cli.misused(args)):
        raise ConfigError(f"{flag} needs --what-if")
    try:
        source = open(args.file, "rb")  # noqa: SIM115 - closed below, after the replay
    except OSError as exc:
        raise InputError(str(exc)) from None
    with source:
        try:
            header = read_header(source)
        except RecordingError as exc:
            raise InputError(f"{args.file}: {exc}") from None
        if args.what_if:
            return whatif_cli.run(args, source, header)
        settings = settings_from_args(args)
        return run_service(lambda stop: _replay_and_report(settings, header, source, args.speed,
                                                           args.progress, args.file, stop))


async def _replay_and_report(settings: NatsSettings, header: FileHeader, source: BinaryIO,
                             speed: float, progress_s: float, name: str,
                             stop: asyncio.Event) -> int:
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
    replay = Replay(nc, Subjects(settings.prefix), header, speed, counts)
    done = asyncio.Event()
    cancelled = threading.Event()  # ends the survey's thread with the replay
    counting = asyncio.ensure_future(asyncio.to_thread(survey, name, cancelled))
    reporting = asyncio.ensure_future(_report_progress(replay, counting, progress_s, done))
    try:
        await replay.run(source, stop)
    except RecordingError as exc:
        raise InputError(f"{name}: {exc}") from None
    except (NatsError, TimeoutError) as exc:
        print(f"lig replay: NATS failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        done.set()
        cancelled.set()
        await asyncio.gather(reporting, counting)
        with contextlib.suppress(NatsError, TimeoutError):
            await within(nc.drain(), 2.0)
    state = "stopped" if stop.is_set() else "done"
    print(f"lig replay: {state}: {counts.snapshots} snapshots, {counts.registry} registry "
          f"writes ({counts.undecodable} snapshots unshifted, {counts.skipped} decisions not "
          f"published)")
    return 0


async def _report_progress(replay: Replay, counting: asyncio.Future[Survey | None],
                           every_s: float, done: asyncio.Event) -> None:
    """A progress line on stderr every ``every_s`` seconds (0: none) until ``done``; the total
    once ``counting`` has counted the file."""
    if not every_s:
        return
    loop = asyncio.get_running_loop()
    while not await wait_set(done, every_s):
        timeline = replay.timeline
        position_s = 0.0 if timeline is None else timeline.position_s(loop.time())
        found = counting.result() if counting.done() else None
        print(progress_line(replay.counts.published(), position_s, found), file=sys.stderr,
              flush=True)


def retimed(data: bytes, timeline: Timeline) -> bytes | None:
    """A snapshot with its scrape time on the replay's clock; None if it is not a
    PodMetrics."""
    try:
        snapshot = decode(data, PodMetrics)
    except DecodeError:
        return None
    return encode(msgspec.structs.replace(
        snapshot, scrape_time_ns=timeline.wall_ns(snapshot.scrape_time_ns)))


class Replay:
    """One pass over a recording onto ``nc`` under ``subjects``."""

    def __init__(self, nc: Client, subjects: Subjects, header: FileHeader, speed: float,
                 counts: ReplayCounts) -> None:
        self.nc = nc
        self.subjects = subjects
        self.header = header
        self.speed = speed
        self.counts = counts
        self.timeline: Timeline | None = None  # set at the first record published at its time
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

    def _start(self, first_ns: int) -> Timeline:
        """The timeline starting now at the record stored at ``first_ns``, saying so when the
        window began noticeably earlier."""
        notice = lead_in_line(self.header.from_ns, first_ns, LEAD_IN_NOTICE_S)
        if notice is not None:
            print(notice, file=sys.stderr, flush=True)
        return Timeline(first_ns, asyncio.get_running_loop().time(), time.time_ns(), self.speed)

    async def run(self, source: BinaryIO, stop: asyncio.Event) -> None:
        """Publish every entry at its (mapped, scaled) time until the file ends or ``stop``."""
        loop = asyncio.get_running_loop()
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
            if self.timeline is None:
                self.timeline = self._start(entry.time_ns)
            delay = self.timeline.due(entry.time_ns) - loop.time()
            if delay > 0:
                await self.nc.flush()
                since_flush = 0
                if await wait_set(stop, delay):
                    return
            if kind == Kind.REGISTRY_CHANGE:
                await self._write_registry(entry)
            elif kind == Kind.SNAPSHOT:
                data = retimed(entry.data or b"", self.timeline)
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
