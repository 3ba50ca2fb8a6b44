"""The built-in HTTP/2 server's server-wide limits: a budget of bytes shared by all its
connections, and a cap on connections. A real server on loopback, driven by raw clients that
follow the server's flow-control windows (so every byte they send is one the server allowed)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import uvloop

from protocols.http2 import ENHANCE_YOUR_CALM, GOAWAY, RST_STREAM, Http2Server, frame
from protocols.http2_limits import MIB, Http2Limits
from tests.support.http2_peer import PATH, Echo, RawClient, grpc_message, trickle

MAX_MESSAGE = 4 * MIB
ROOT = str(Path(__file__).resolve().parents[1])


def held(server: Http2Server) -> int:
    """Bytes of partial messages and parked answers across the server's connections."""
    return sum(connection.buffered_bytes + connection.parked_bytes
               for connection in server._connections)


async def test_large_partial_messages_on_many_connections_stay_within_the_budget() -> None:
    limit = 12 * MIB  # each connection may hold 5 MiB: 6 attackers could make it 24 MiB
    server = Http2Server({PATH: lambda: Echo([])}, MAX_MESSAGE,
                         limits=Http2Limits(max_total_buffered=limit, max_connections=16))
    port = await server.start("127.0.0.1", 0)
    attackers: list[RawClient] = []
    try:
        # Each attacker announces a message of the largest size and sends all of it but the
        # last byte, as fast as the server's windows allow; never the end. The server's
        # accounting is checked after every round.
        for _ in range(6):
            attackers.append(await RawClient.connect(port))
        peaks: list[int] = []
        offsets = await trickle(attackers, MAX_MESSAGE,
                                after_round=lambda: peaks.append(held(server)))
        peak = max(peaks)
        assert peak <= limit, f"{peak} bytes held, over the {limit} budget"
        # Each attacker went on until its call was ended or the server's windows stopped it
        # (against the server before the budget, they held 24 MiB).
        for attacker, sent in zip(attackers, offsets, strict=True):
            assert attacker.status(1) == "8" or sent == MAX_MESSAGE + 4 \
                or min(attacker.window, attacker.stream_windows[1]) == 0
        assert held(server) <= server.reserved_bytes <= limit  # the server's own accounting
        # A well-behaved client on another connection: small calls, and one larger than the
        # default window, which can complete only once the largest attacker message is ended.
        honest = await RawClient.connect(port)
        for stream_id in (1, 3, 5):
            honest.open(stream_id)
            honest.send(stream_id, grpc_message(b"small%d" % stream_id), end=True)
        medium = grpc_message(b"m" * (512 * 1024))
        honest.open(7)
        offset = 0
        for _ in range(100):
            offset += honest.send(7, medium[offset:], end=True)
            await honest.writer.drain()
            await honest.pump(0.05)
            if honest.status(7) is not None:
                break
        for stream_id in (1, 3, 5):
            assert honest.status(stream_id) == "0"
            assert honest.answers(stream_id) == grpc_message(b"echo:small%d" % stream_id)
        assert honest.status(7) == "0" and len(honest.answers(7)) == len(medium) + 5
        assert not honest.eof
        # Attackers' calls (not the honest ones) were ended with RESOURCE_EXHAUSTED. (Read
        # until one is seen: how soon a loaded machine delivers it is not what is tested.)
        for _ in range(200):  # bounded by a count: reading all of them, 10 ms quiet each
            for attacker in attackers:
                await attacker.pump(0.01)
            if "8" in [attacker.status(1) for attacker in attackers]:
                break
        assert "8" in [attacker.status(1) for attacker in attackers]
        assert held(server) <= server.reserved_bytes <= limit
        honest.close()
    finally:
        for attacker in attackers:
            attacker.close()
        await server.stop(0.5)
    assert server.budget.used == 0  # every connection returned what it reserved


async def test_connections_past_the_cap_are_closed_and_counted() -> None:
    await _connections_past_the_cap()


def test_connections_past_the_cap_are_told_why_on_uvloop() -> None:
    # The picker runs on uvloop, whose transports are no asyncio.Transport subclasses: the
    # refusal once asserted they were, and closed without its GOAWAY.
    uvloop.run(_connections_past_the_cap())


async def _connections_past_the_cap() -> None:
    errors: list[str] = []
    server = Http2Server({PATH: lambda: Echo([])}, 1000,
                         limits=Http2Limits(max_connections=3), on_error=errors.append)
    port = await server.start("127.0.0.1", 0)
    clients: list[RawClient] = []
    try:
        for _ in range(3):
            clients.append(await RawClient.connect(port))
        assert not errors
        refused = await RawClient.connect(port)
        await refused.pump_until(lambda: False)  # until it is closed (or 10 s of nothing)
        assert refused.eof
        goaways = [payload for kind, _, _, payload in refused.frames if kind == GOAWAY]
        assert [int.from_bytes(payload[4:8], "big") for payload in goaways] == [ENHANCE_YOUR_CALM]
        assert errors == ["ENHANCE_YOUR_CALM"] and server.connections == 3
        refused.close()
        # A closed connection makes room: a new one is served.
        clients.pop().close()
        for _ in range(500):  # a loaded machine may take a while to see it closed
            if server.connections < 3:
                break
            await asyncio.sleep(0.02)
        client = await RawClient.connect(port)
        clients.append(client)
        client.open(1)
        client.send(1, grpc_message(b"hi"), end=True)
        await client.pump_until(lambda: client.status(1) is not None)
        assert client.status(1) == "0" and errors == ["ENHANCE_YOUR_CALM"]
    finally:
        for client in clients:
            client.close()
        await server.stop(0.5)


_SERVER = """
import asyncio, sys
from protocols.http2 import Http2Server
from protocols.http2_limits import MIB, Http2Limits
from tests.support.http2_peer import PATH, Echo

async def main():
    limits = Http2Limits(max_total_buffered=16 * MIB, max_connections=16)
    server = Http2Server({PATH: lambda: Echo([])}, 4 * MIB, limits=limits)
    print(await server.start("127.0.0.1", 0), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until closed
    await server.stop(0.5)

asyncio.run(main())
"""


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_the_server_process_grows_by_at_most_the_budget() -> None:
    """12 connections x 4 MiB partial messages: a server process with a 16 MiB budget grows by
    the budget and some slack, not by the 48 MiB sent its way before the budget."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _SERVER, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": ROOT})
    assert process.stdout is not None and process.stdin is not None
    attackers: list[RawClient] = []
    try:
        port = int(await asyncio.wait_for(process.stdout.readline(), 20.0))
        for _ in range(12):
            attackers.append(await RawClient.connect(port))
        before = _rss(process.pid)
        peaks: list[int] = []
        await trickle(attackers, MAX_MESSAGE,
                      after_round=lambda: peaks.append(_rss(process.pid)))
        growth = max(peaks) - before
        assert growth <= 28 * MIB, f"RSS grew by {growth / MIB:.0f} MiB"
    finally:
        for attacker in attackers:
            attacker.close()
        process.stdin.close()
        await asyncio.wait_for(process.wait(), 10.0)


async def test_a_window_left_idle_is_taken_back_by_closing_its_connection() -> None:
    """A client announces a large message, so it is granted window for it, then resets the
    call and sends nothing more: that window holds budget an honest large message needs. The
    server closes the idle connection (GOAWAY ENHANCE_YOUR_CALM) rather than end the honest
    call, whose partial message is the largest one left."""
    errors: list[str] = []
    limits = Http2Limits(max_connections=4)
    limit = 4 * 65_535 + limits.buffered_cap(MAX_MESSAGE)  # the least the server accepts
    server = Http2Server({PATH: lambda: Echo([])}, MAX_MESSAGE, on_error=errors.append,
                         limits=Http2Limits(max_connections=4, max_total_buffered=limit))
    port = await server.start("127.0.0.1", 0)
    idle = honest = None
    try:
        idle = await RawClient.connect(port)
        idle.open(1)
        idle.send(1, b"\x00" + MAX_MESSAGE.to_bytes(4, "big") + b"i" * 100)
        await idle.writer.drain()
        await idle.pump_until(lambda: idle.window > 4 * MIB)
        assert idle.window > 4 * MIB  # granted for the announced message
        idle.writer.write(frame(RST_STREAM, 0, 1, (0).to_bytes(4, "big")))
        await idle.writer.drain()
        honest = await RawClient.connect(port)
        message = grpc_message(b"h" * (2 * MIB))
        honest.open(1)
        offset = 0
        for _ in range(200):  # bounded: each round sends what the windows allow
            offset += honest.send(1, message[offset:], end=True)
            await honest.writer.drain()
            await honest.pump(0.05)
            if honest.status(1) is not None:
                break
        assert honest.status(1) == "0" and len(honest.answers(1)) == len(message) + 5
        await idle.pump_until(lambda: False)  # until it is closed (or 10 s of nothing)
        assert idle.eof and [int.from_bytes(payload[4:8], "big") for kind, _, _, payload
                             in idle.frames if kind == GOAWAY] == [ENHANCE_YOUR_CALM]
        assert errors == ["ENHANCE_YOUR_CALM"]
        assert server.reserved_bytes <= limit
    finally:
        for client in (idle, honest):
            if client is not None:
                client.close()
        await server.stop(0.5)
