"""The built-in HTTP/2 server's resource limits, and the budgets that enforce them.

:class:`Http2Limits` holds every bound (see :mod:`protocols.http2` for what each protects
against and where the defaults come from); :class:`TokenBucket` is a per-connection budget for
frames that cost work without making progress; :class:`BufferBudget` is the server-wide budget
of bytes all connections may make the server hold.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

KIB = 1024
MIB = 1024 * KIB


class Http2Limits(msgspec.Struct, frozen=True):
    """Bounds on what one client connection, and all of them together, may make the server
    hold or do."""

    # Connections open at once per server; one more is closed at once (GOAWAY
    # ENHANCE_YOUR_CALM).
    max_connections: int = 1024
    # Bytes all connections together may make the server hold: receive windows granted,
    # partial request messages and answers waiting for window. At least the default window
    # (64 KiB) of every allowed connection, set aside for each, plus one connection's buffer
    # cap (one message of the largest size always fits).
    max_total_buffered: int = 256 * MIB

    # SETTINGS_MAX_CONCURRENT_STREAMS, advertised and enforced (REFUSED_STREAM past it).
    max_concurrent_streams: int = 1000
    # Receive window each new stream starts with; a message announced larger gets a window for
    # the whole message (up to the gRPC max message size) once its 5-byte prefix has arrived.
    stream_window: int = 1 * MIB
    # Bytes of partial messages one connection may hold; also its receive window. None: the
    # max message size + 1 MiB (one message of the largest size always fits).
    max_buffered: int | None = None
    # Bytes of answers one connection may hold while they wait for the client's flow-control
    # window (a client that sends requests but grants no window). None: the same as the
    # buffer cap. Past it: GOAWAY ENHANCE_YOUR_CALM.
    max_parked: int | None = None
    # One header block (HEADERS + CONTINUATION), compressed and decoded; gRPC core's hard
    # default for metadata is 16 KiB too.
    max_header_block: int = 16 * KIB
    max_header_list: int = 16 * KIB
    # CONTINUATION frames in one header block (h2 keeps at most 64).
    max_continuations: int = 64
    # Frames that cost work without progress: SETTINGS, PING, PRIORITY, unknown types, empty
    # DATA/HEADERS/CONTINUATION. A bucket of `burst`, refilled per second.
    control_burst: int = 1000
    control_rate: float = 500.0
    # Streams that end before any answer: reset by the client (rapid reset, CVE-2023-44487),
    # refused past the concurrency limit, or naming an unknown method.
    reset_burst: int = 2000
    reset_rate: float = 1000.0
    # Pause reading while the transport holds more unsent bytes than this; resume below low.
    write_high_water: int = 1 * MIB
    write_low_water: int = 256 * KIB
    # Seconds to receive the client preface and its first SETTINGS frame (Envoy, like every
    # gRPC client, sends both as soon as it connects).
    preface_timeout: float = 5.0
    # Seconds without an open stream after which the connection is drained (two-step GOAWAY).
    idle_timeout: float = 300.0

    def buffered_cap(self, max_message: int) -> int:
        """The connection's buffer cap (and receive window) for messages up to ``max_message``."""
        return self.max_buffered if self.max_buffered is not None else max_message + 5 + MIB

    def parked_cap(self, max_message: int) -> int:
        """Bytes of answers waiting for window one connection may hold."""
        return self.max_parked if self.max_parked is not None else self.buffered_cap(max_message)


class TokenBucket:
    """``burst`` tokens, refilled at ``rate`` per second; :meth:`take` fails when empty."""

    __slots__ = ("_burst", "_clock", "_rate", "_stamp", "_tokens")

    def __init__(self, burst: int, rate: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._burst = float(burst)
        self._rate = rate
        self._clock = clock
        self._tokens = float(burst)
        self._stamp = clock()

    def take(self) -> bool:
        """Spend one token; False when none is left."""
        if self._tokens < 1.0:
            now = self._clock()
            self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
            self._stamp = now
            if self._tokens < 1.0:
                return False
        self._tokens -= 1.0
        return True


class BufferBudget:
    """Bytes the connections of one server may reserve, ``limit`` in all: a connection reserves
    what it may be made to hold (the receive window it granted, its partial messages, its
    answers waiting for window) before granting or parking, so the total held stays within."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    @property
    def free(self) -> int:
        """Bytes no connection has reserved."""
        return self.limit - self.used

    def grant(self, amount: int) -> int:
        """Reserve up to ``amount`` bytes; returns how many were reserved (0 when spent)."""
        granted = max(0, min(amount, self.limit - self.used))
        self.used += granted
        return granted

    def give_back(self, amount: int) -> None:
        """Return ``amount`` reserved bytes."""
        self.used -= amount
