"""Loopback ports that stay ours until a child binds them.

A port found free by binding port 0 lies in the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), and any outgoing
connection of the stack itself (a NATS client, a scrape, Envoy dialling a picker) may take it in
the seconds before the child that was meant to bind it does: ``Address already in use`` on a
simulated pod's KV-event socket. And two allocators running at once (two ``lig up
--free-ports``, the workers of a parallel test run) may both find the same port free.

So ports are leased:
- from below the ephemeral range, where the kernel never puts an outgoing connection;
- in blocks of :data:`BLOCK` consecutive ports, each claimed by an exclusive ``flock`` on a file
  of its own in a folder shared by the user's processes (:func:`lease_folder`), held for as long
  as the claiming :class:`PortLeases` (normally: its process) lives. The kernel releases the lock
  when the process dies, however it dies, so a crash leaks nothing;
- within its blocks a process hands out each port once, after checking it is free by binding it
  (something outside any lease may listen there).

Only processes that lease ports are kept apart this way; a program that binds fixed ports below
the ephemeral range is still seen by the bind check.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
from collections.abc import Iterable
from pathlib import Path

from shared.errors import LigError

LOOPBACK = "127.0.0.1"
BLOCK = 64
# The leased range starts here: clear of the well-known and registered ports most servers use
# (and of this project's defaults, 8081-9303).
FLOOR = 10_000
# The kernel's default start of the ephemeral range, when /proc does not say.
DEFAULT_EPHEMERAL_START = 32_768
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


class NoFreePorts(LigError, RuntimeError):
    """No block of the leased range could be claimed (every one leased or in use)."""


def ephemeral_start(path: Path = EPHEMERAL_RANGE_FILE) -> int:
    """The first port of the kernel's ephemeral range (where outgoing connections get theirs)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_START


def leased_range(start: int | None = None) -> range:
    """The ports leases come from: ``FLOOR`` up to the ephemeral range.

    A machine whose ephemeral range starts too low to leave room (under ``FLOOR`` + 16 blocks)
    gets ``FLOOR``-32767 anyway: leases still keep allocators apart there, only not from
    outgoing connections.
    """
    end = ephemeral_start() if start is None else start
    if end < FLOOR + 16 * BLOCK:
        end = DEFAULT_EPHEMERAL_START
    return range(FLOOR, end - (end - FLOOR) % BLOCK)


def lease_folder() -> Path:
    """Where the block lock files live: one folder per user, shared by all their processes."""
    return Path(tempfile.gettempdir()) / f"lig-port-leases-{os.getuid()}"


def bindable(port: int) -> bool:
    """Whether nothing listens on (or holds) ``port`` on loopback.

    ``SO_REUSEADDR`` as every server sets it: an earlier connection lingering in TIME_WAIT does
    not make a port busy, a listener does.
    """
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


class PortLeases:
    """Free loopback ports, none handed out twice and none to two processes at once.

    Keep the object (and so its leases) alive until every port it gave is bound; :meth:`close`
    or the process's end releases them.
    """

    def __init__(self, ports: range | None = None, folder: Path | None = None,
                 rng: random.Random | None = None) -> None:
        self._range = leased_range() if ports is None else ports
        self._folder = lease_folder() if folder is None else folder
        self._rng = rng or random.Random()
        self._locks: dict[int, int] = {}  # first port of a block -> the fd holding its lock
        self._spare: list[int] = []  # ports of the current block not handed out yet
        self._avoid: set[int] = set()

    def take(self) -> int:
        """One free port."""
        while True:
            while self._spare:
                port = self._spare.pop(0)
                if port not in self._avoid and bindable(port):
                    return port
            first = self._claim(1)
            self._spare = list(range(first, first + BLOCK))

    def take_consecutive(self, count: int) -> int:
        """The first of ``count`` consecutive free ports (whole blocks of their own)."""
        if count < 1:
            raise ValueError("count must be at least 1")
        for _ in range(len(self._range) // BLOCK):
            first = self._claim(-(-count // BLOCK))
            ports = range(first, first + count)
            if self._avoid.isdisjoint(ports) and all(bindable(port) for port in ports):
                return first
        raise NoFreePorts(f"no {count} consecutive free ports in {self._describe()}")

    def avoid(self, ports: Iterable[int]) -> None:
        """Never hand out ``ports`` (those the caller will bind itself, e.g. configured pods)."""
        self._avoid.update(ports)

    def close(self) -> None:
        """Release every lease (the ports handed out may then go to another process)."""
        for fd in self._locks.values():
            os.close(fd)
        self._locks.clear()
        self._spare.clear()

    def __enter__(self) -> PortLeases:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _claim(self, blocks: int) -> int:
        """Lock ``blocks`` adjacent blocks no other process holds; the first port of the first."""
        starts = list(range(self._range.start, self._range.stop - (blocks - 1) * BLOCK, BLOCK))
        if not starts:
            raise NoFreePorts(f"{blocks} blocks of {BLOCK} do not fit in {self._describe()}")
        # Start anywhere: allocators running at once rarely even try the same block.
        offset = self._rng.randrange(len(starts))
        self._folder.mkdir(mode=0o700, exist_ok=True)
        for start in starts[offset:] + starts[:offset]:
            wanted = [start + i * BLOCK for i in range(blocks)]
            if any(block in self._locks for block in wanted):
                continue
            fds: list[int] = []
            for block in wanted:
                fd = self._lock(block)
                if fd is None:
                    break
                fds.append(fd)
            if len(fds) == blocks:
                self._locks.update(zip(wanted, fds, strict=True))
                return start
            for fd in fds:
                os.close(fd)
        raise NoFreePorts(f"every block of {self._describe()} is leased or in use")

    def _lock(self, block: int) -> int | None:
        fd = os.open(self._folder / f"{block}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def _describe(self) -> str:
        return f"ports {self._range.start}-{self._range.stop - 1} (leases in {self._folder})"
