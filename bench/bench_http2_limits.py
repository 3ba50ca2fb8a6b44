"""Attack measurements against the picker's built-in HTTP/2 server, before and after its limits.

Each case runs against the current server and, as the in-run baseline, the server as it was
before the limits (``--old-rev``, read from git), on the same machine in the same run:

- parked streams: a client opens N streams granting no send window (INITIAL_WINDOW_SIZE 0), so
  every answer waits; then the time for 5 SETTINGS frames (median of repetitions) and for a
  PING to be answered. The concurrency limit is raised to N for the current server so that the
  parking cost itself is measured; with the default limit the flood is refused (also shown).
  Issue 13 measured 1.8 s / 7.9 s / 20 s at 10k / 20k / 30k streams; target: a few ms, flat.
- amplification: a 4,000-byte non-UTF-8 ``:path`` indexed once, then 12-byte HEADERS frames
  naming it, ~60 KB in all, over loopback to a real server from a client that never reads;
  RSS growth of a fresh process per server. Target: < 20 MB (issue 13: +79 MB).
- a 1 MiB HEADERS frame of HPACK table size updates: CPU to refuse it (issue 13: 0.87 s).
- partial messages: 12 streams x 8 MiB of messages claiming 64 MiB: bytes the server holds.
- many connections: N connections over loopback (a fresh process per server), each announcing
  a 32 MiB message and sending it in 1 MiB DATA frames as fast as the server's windows allow,
  never the end; the server's RSS growth and the bytes it holds, against the server before the
  server-wide budget (``--budget-old-rev``). Target: within the budget (256 MiB); the old server
  grows by ~N x 32 MiB.
- hot path: CPU per small call (HEADERS + a 300-byte message + END_STREAM, echoed), in-process,
  100 calls per read, median of repeats, against the same old server: what the budget's
  accounting costs per call.

Run: ``.venv/bin/python bench/bench_http2_limits.py [--streams 10000,20000,30000]``. Every
loop is bounded in count; the amplification client stops after 10 s at most.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import hpack

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.baseline import module_at  # noqa: E402
from protocols import http2 as new_http2  # noqa: E402
from protocols import http2_limits  # noqa: E402
from protocols.http2_limits import MIB, BufferBudget, Http2Limits  # noqa: E402
from tests.support.http2_peer import (  # noqa: E402
    PATH,
    Echo,
    FakeTransport,
    RawClient,
    grpc_message,
    parse,
    trickle,
)

OLD_REV = "ae025d4"  # the last commit before the limits
BUDGET_OLD_REV = "73d092c"  # the last commit before the server-wide budget
PAGE = os.sysconf("SC_PAGE_SIZE")


def load_old(rev: str) -> ModuleType:
    """The server module as it was at ``rev`` (from git), importable beside the current one.

    The old revisions kept it in services/picker/, and the budget's baseline imports
    ``services.picker.http2_limits``: that name is given the current limits module, as the old
    server got before the protocol code moved to protocols/."""
    sys.modules.setdefault("services.picker.http2_limits", http2_limits)
    return module_at(rev, "services/picker/http2.py", "http2_old")


def connection(module: ModuleType, max_message: int = 1000,
               limits: Http2Limits | None = None,
               budget: BufferBudget | None = None) -> tuple[Any, FakeTransport]:
    """A connection of ``module``'s server on a fake transport, past the client preface."""
    handlers = {PATH: lambda: Echo([])}
    if module is new_http2:
        conn = module.Http2Connection(handlers, max_message, limits=limits, budget=budget)
    else:
        conn = module.Http2Connection(handlers, max_message)
    transport = FakeTransport()
    transport.protocol = conn
    conn.connection_made(transport)
    return conn, transport


def hot_path(module: ModuleType, calls: int, repeats: int) -> float:
    """Median CPU seconds per small call, 100 calls per read (as Envoy batches them)."""
    budget = BufferBudget(256 * MIB) if module is new_http2 else None
    timings = []
    for _ in range(repeats):
        conn, transport = connection(module, max_message=4 * MIB, budget=budget)
        window = new_http2.MAX_WINDOW
        conn.data_received(new_http2.PREFACE + new_http2.frame(
            new_http2.SETTINGS, 0, 0, new_http2.INITIAL_WINDOW_SIZE.to_bytes(2, "big")
            + window.to_bytes(4, "big"))
            + new_http2.frame(new_http2.SETTINGS, new_http2.ACK, 0)
            + new_http2.frame(new_http2.WINDOW_UPDATE, 0, 0,
                              (window - 65_535).to_bytes(4, "big")))
        encoder = hpack.Encoder()
        encoder.header_table_size = 0
        fields: list[tuple[str, str | bytes]] = [
            (":method", "POST"), (":scheme", "http"), (":path", PATH),
            (":authority", "picker"), ("content-type", "application/grpc")]
        message = grpc_message(b"m" * 300)
        # The first block carries the table size update; every later one is the same bytes.
        conn.data_received(new_http2.frame(new_http2.HEADERS, new_http2.END_HEADERS, 1,
                                           encoder.encode(fields))
                           + new_http2.frame(new_http2.DATA, new_http2.END_STREAM, 1, message))
        block = encoder.encode(fields)
        stream = 3
        started = time.process_time()
        for _ in range(calls // 100):
            batch = bytearray()
            for _ in range(100):
                batch += new_http2.frame(new_http2.HEADERS, new_http2.END_HEADERS, stream, block)
                batch += new_http2.frame(new_http2.DATA, new_http2.END_STREAM, stream, message)
                stream += 2
            conn.data_received(bytes(batch))
            transport.written.clear()
        timings.append((time.process_time() - started) / calls)
        assert not transport.closed
    return statistics.median(timings)


def header_blocks(count: int) -> list[bytes]:
    """HPACK blocks for ``count`` calls of PATH, from one encoder (the table in use)."""
    encoder = hpack.Encoder()
    return [encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", PATH),
                            (":authority", "picker"), ("content-type", "application/grpc")])
            for _ in range(count)]


def parked(module: ModuleType, streams: int, repeats: int) -> dict[str, float]:
    """Open ``streams`` calls whose answers wait for window; time 5 SETTINGS and a PING."""
    limits = Http2Limits(max_concurrent_streams=streams, reset_burst=streams + 10)
    conn, transport = connection(module, limits=limits)
    initial_zero = (4).to_bytes(2, "big") + (0).to_bytes(4, "big")
    conn.data_received(new_http2.PREFACE + new_http2.frame(new_http2.SETTINGS, 0, 0, initial_zero))
    started = time.perf_counter()
    blocks = header_blocks(streams)
    message = grpc_message(b"x")
    for first in range(0, streams, 1000):
        conn.data_received(b"".join(
            new_http2.frame(new_http2.HEADERS, new_http2.END_HEADERS, 2 * i + 1, blocks[i])
            + new_http2.frame(new_http2.DATA, 0, 2 * i + 1, message)
            for i in range(first, min(first + 1000, streams))))
    setup = time.perf_counter() - started
    assert conn.open_streams == streams, conn.open_streams
    five = new_http2.frame(new_http2.SETTINGS, 0, 0) * 5
    times = []
    for _ in range(repeats):
        transport.written.clear()
        started = time.perf_counter()
        conn.data_received(five)
        times.append(time.perf_counter() - started)
    transport.written.clear()
    started = time.perf_counter()
    conn.data_received(new_http2.frame(new_http2.PING, 0, 0, b"12345678"))
    ping = time.perf_counter() - started
    assert (new_http2.PING, 1, 0, b"12345678") in parse(bytes(transport.written))
    return {"setup_s": setup, "settings5_s": statistics.median(times), "ping_s": ping}


def flood_with_default_limits(streams: int) -> str:
    """What the default limits make of a flood of ``streams`` parked calls."""
    conn, transport = connection(new_http2)
    blocks = header_blocks(streams)
    conn.data_received(new_http2.PREFACE + new_http2.frame(
        new_http2.SETTINGS, 0, 0, (4).to_bytes(2, "big") + (0).to_bytes(4, "big")))
    wire = b"".join(new_http2.frame(new_http2.HEADERS, new_http2.END_HEADERS, 2 * i + 1, blocks[i])
                    + new_http2.frame(new_http2.DATA, 0, 2 * i + 1, grpc_message(b"x"))
                    for i in range(streams))
    conn.data_received(wire)
    frames = parse(bytes(transport.written))
    refused = sum(1 for kind, _, _, payload in frames
                  if kind == new_http2.RST_STREAM and payload == (7).to_bytes(4, "big"))
    goaways = [int.from_bytes(payload[4:8], "big") for kind, _, _, payload in frames
               if kind == new_http2.GOAWAY]
    ending = new_http2.ERROR_NAMES.get(goaways[-1], "?") if goaways else "still open"
    return f"{conn.open_streams} open, {refused} refused, connection: {ending}"


def huge_headers(module: ModuleType) -> float:
    """CPU seconds to deal with one 1 MiB HEADERS frame of table size updates."""
    conn, _ = connection(module)
    conn.data_received(new_http2.PREFACE + new_http2.frame(new_http2.SETTINGS, 0, 0))
    wire = new_http2.frame(new_http2.HEADERS, new_http2.END_HEADERS, 1, b"\x20" * (1 << 20))
    started = time.process_time()
    conn.data_received(wire)
    return time.process_time() - started


def partial_messages(module: ModuleType) -> int:
    """Bytes held after 12 streams x 8 MiB of messages that claim 64 MiB."""
    max_message = 64 << 20
    conn, transport = connection(module, max_message=max_message)
    conn.data_received(new_http2.PREFACE + new_http2.frame(new_http2.SETTINGS, 0, 0))
    chunk = b"\x00" + max_message.to_bytes(4, "big") + b"p" * ((1 << 20) - 5)
    rest = b"p" * (1 << 20)
    blocks = header_blocks(12)
    for i in range(12):
        stream = 2 * i + 1
        conn.data_received(new_http2.frame(new_http2.HEADERS, new_http2.END_HEADERS, stream,
                                           blocks[i]))
        for part in range(8):
            if transport.closed:
                break
            conn.data_received(new_http2.frame(new_http2.DATA, 0, stream, rest if part else chunk))
    return sum(len(stream.inbox) for stream in conn._streams.values())


def rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


async def amplification(module: ModuleType, frames: int) -> dict[str, float]:
    """RSS growth while a client that never reads sends indexed-path HEADERS over loopback."""
    server = module.Http2Server({PATH: lambda: Echo([])}, 64 << 20)
    port = await server.start("127.0.0.1", 0)
    before = rss()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that does not read
    encoder = hpack.Encoder()
    path = b"/\xff" * 2000
    first = encoder.encode([(b":method", b"POST"), (b":path", path)])
    again = encoder.encode([(b":method", b"POST"), (b":path", path)])
    wire = bytearray(new_http2.PREFACE + new_http2.frame(new_http2.SETTINGS, 0, 0)
                     + new_http2.frame(new_http2.HEADERS, 5, 1, first))
    for i in range(frames):
        wire += new_http2.frame(new_http2.HEADERS, 5, 2 * i + 3, again)
    loop = asyncio.get_running_loop()
    sent = 0
    started = time.monotonic()
    while sent < len(wire) and time.monotonic() - started < 10.0:
        try:
            sent += sock.send(wire[sent: sent + 65536])
        except BlockingIOError:
            await asyncio.sleep(0.01)
        except OSError:
            break  # the server closed the connection (ENHANCE_YOUR_CALM)
    stall_started = loop.time()
    await asyncio.sleep(0.5)  # the server's loop gets to work through what arrived
    stall = loop.time() - stall_started - 0.5
    growth = rss() - before
    sock.close()
    await server.stop(0.5)
    return {"sent_kb": sent / 1024, "rss_growth_mb": growth / 2**20, "loop_stall_s": stall}


async def many_connections(module: ModuleType, connections: int) -> dict[str, float]:
    """RSS growth while ``connections`` clients each trickle in most of a 32 MiB message."""
    max_message = 33 << 20  # the picker's
    server = module.Http2Server({PATH: lambda: Echo([])}, max_message)
    port = await server.start("127.0.0.1", 0)
    before = rss()
    clients = [await RawClient.connect(port) for _ in range(connections)]
    size = 32 << 20
    sent = await trickle(clients, size, seconds=60.0)
    await asyncio.sleep(0.3)  # the server reads what is in flight
    growth = rss() - before
    held = sum(connection.buffered_bytes + connection.parked_bytes
               for connection in server._connections)
    sent_total = sum(sent)
    ended = sum(client.status(1) is not None for client in clients)
    for client in clients:
        client.close()
    await server.stop(0.5)
    return {"sent_mb": sent_total / 2**20, "held_mb": held / 2**20,
            "rss_growth_mb": growth / 2**20, "calls_ended": ended}


def child(case: str, rev: str, frames: int, connections: int) -> None:
    """Run the amplification (or, with ``connections``, the many-connections) case for one
    server in this (fresh) process; print JSON."""
    module = new_http2 if case == "new" else load_old(rev)
    if connections:
        print(json.dumps(asyncio.run(many_connections(module, connections))))
    else:
        print(json.dumps(asyncio.run(amplification(module, frames))))


def in_child(case: str, rev: str, frames: int, connections: int = 0) -> dict[str, float]:
    """One case in a fresh process, so that RSS growth is the server's alone."""
    output = subprocess.run([sys.executable, __file__, "--child", case, "--old-rev", rev,
                             "--frames", str(frames), "--child-connections", str(connections)],
                            check=True, capture_output=True, text=True, timeout=180,
                            cwd=ROOT).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    """Measure every case for the current and the old server; print a table and the verdicts."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="10000,20000,30000",
                        help="parked-stream counts (comma-separated)")
    parser.add_argument("--old-max-streams", type=int, default=10_000,
                        help="largest count the old server is measured at (it is quadratic)")
    parser.add_argument("--repeats", type=int, default=7, help="SETTINGS timings per count")
    parser.add_argument("--frames", type=int, default=5000,
                        help="12-byte HEADERS frames in the amplification case (~60 KB)")
    parser.add_argument("--old-rev", default=OLD_REV, help="git revision of the old server")
    parser.add_argument("--connections", type=int, default=16,
                        help="connections in the many-connections case (0: skip it)")
    parser.add_argument("--budget-old-rev", default=BUDGET_OLD_REV,
                        help="git revision of the server before the server-wide budget")
    parser.add_argument("--only-connections", action="store_true",
                        help="run only the server-wide budget's cases (hot path, connections)")
    parser.add_argument("--child", choices=["new", "old"], help=argparse.SUPPRESS)
    parser.add_argument("--child-connections", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.old_rev, args.frames, args.child_connections)
        return
    if args.only_connections:
        for text, passed in hot_path_verdicts(args) + connection_verdicts(args):
            print(f"  {'PASS' if passed else 'FAIL'} {text}")
        return
    old = load_old(args.old_rev)
    counts = [int(count) for count in args.streams.split(",")]
    verdicts = []
    print(f"bench_http2_limits: old server = {args.old_rev}, medians of {args.repeats}")
    print(f"{'parked streams':>14} {'server':>6} {'setup s':>8} {'5 SETTINGS ms':>14} "
          f"{'PING ms':>8} {'ratio old/new':>14}")
    empty = parked(new_http2, 1, args.repeats)
    print(f"{1:>14} {'new':>6} {empty['setup_s']:8.3f} {empty['settings5_s'] * 1e3:14.3f} "
          f"{empty['ping_s'] * 1e3:8.3f} {'(baseline)':>14}")
    for count in counts:
        new = parked(new_http2, count, args.repeats)
        ratio = ""
        if count <= args.old_max_streams:
            before = parked(old, count, 1)
            ratio = f"{before['settings5_s'] / new['settings5_s']:.0f}x"
            print(f"{count:>14} {'old':>6} {before['setup_s']:8.3f} "
                  f"{before['settings5_s'] * 1e3:14.1f} {before['ping_s'] * 1e3:8.3f}")
        print(f"{count:>14} {'new':>6} {new['setup_s']:8.3f} {new['settings5_s'] * 1e3:14.3f} "
              f"{new['ping_s'] * 1e3:8.3f} {ratio:>14}")
        verdicts.append((f"5 SETTINGS at {count} parked streams "
                         f"{new['settings5_s'] * 1e3:.2f} ms <= 10 ms "
                         f"({new['settings5_s'] / empty['settings5_s']:.1f}x the 1-stream time)",
                         new["settings5_s"] <= 0.010))
        verdicts.append((f"PING answered in {new['ping_s'] * 1e3:.2f} ms <= 1000 ms at {count}",
                         new["ping_s"] <= 1.0))
    print(f"default limits, a flood of {counts[-1]} parked streams: "
          f"{flood_with_default_limits(counts[-1])}")
    old_headers, new_headers = huge_headers(old), huge_headers(new_http2)
    print(f"1 MiB HEADERS of table size updates: old {old_headers:.3f} s CPU, "
          f"new {new_headers * 1e3:.3f} ms CPU")
    verdicts.append((f"1 MiB HEADERS refused in {new_headers * 1e3:.2f} ms CPU <= 10 ms",
                     new_headers <= 0.010))
    old_held, new_held = partial_messages(old), partial_messages(new_http2)
    print(f"12 x 8 MiB partial messages: old holds {old_held / 2**20:.0f} MiB, "
          f"new {new_held / 2**20:.0f} MiB (cap {Http2Limits().buffered_cap(64 << 20) / 2**20:.0f}"
          " MiB)")
    for case in ("old", "new"):
        figures = in_child(case, args.old_rev, args.frames)
        print(f"amplification ({case}): sent {figures['sent_kb']:.0f} KB, RSS "
              f"+{figures['rss_growth_mb']:.1f} MB, loop stall {figures['loop_stall_s']:.2f} s")
        if case == "new":
            verdicts.append((f"amplification RSS growth {figures['rss_growth_mb']:.1f} MB < 20 MB",
                             figures["rss_growth_mb"] < 20))
    verdicts += hot_path_verdicts(args) + connection_verdicts(args)
    for text, passed in verdicts:
        print(f"  {'PASS' if passed else 'FAIL'} {text}")


def hot_path_verdicts(args: argparse.Namespace) -> list[tuple[str, bool]]:
    """CPU per small call, the old (``--budget-old-rev``) server as the baseline."""
    old = load_old(args.budget_old_rev)
    calls = 20_000
    # Interleaved, so that the machine's load drifts over both alike.
    befores, afters = [], []
    for _ in range(args.repeats):
        befores.append(hot_path(old, calls, 1))
        afters.append(hot_path(new_http2, calls, 1))
    before, after = statistics.median(befores), statistics.median(afters)
    print(f"hot path, {calls} small calls, median of {args.repeats}: old "
          f"{before * 1e6:.2f} us/call, new {after * 1e6:.2f} us/call, "
          f"new/old {after / before:.3f}")
    return [(f"hot path: new/old CPU per call {after / before:.3f} <= 1.05",
             after / before <= 1.05)]


def connection_verdicts(args: argparse.Namespace) -> list[tuple[str, bool]]:
    """The many-connections case for the old (``--budget-old-rev``) and current server."""
    if not args.connections:
        return []
    budget = Http2Limits().max_total_buffered
    verdicts = []
    for case in ("old", "new"):
        figures = in_child(case, args.budget_old_rev, args.frames, args.connections)
        print(f"{args.connections} connections x 32 MiB partial messages ({case}): sent "
              f"{figures['sent_mb']:.0f} MiB, held {figures['held_mb']:.0f} MiB, RSS "
              f"+{figures['rss_growth_mb']:.0f} MiB, calls ended {figures['calls_ended']:.0f}")
        if case == "new":
            verdicts.append((f"{args.connections} connections: held {figures['held_mb']:.0f} MiB"
                             f" <= budget {budget / 2**20:.0f} MiB",
                             figures["held_mb"] * 2**20 <= budget))
            verdicts.append((f"{args.connections} connections: RSS growth "
                             f"{figures['rss_growth_mb']:.0f} MiB <= budget + 64 MiB",
                             figures["rss_growth_mb"] * 2**20 <= budget + 64 * 2**20))
    return verdicts


if __name__ == "__main__":
    main()
