"""Loopback ports for test processes."""

from __future__ import annotations

import socket
import time

from lig.port_leases import PortLeases

# This test process's leases (lig/port_leases.py), held until it exits: a port handed out here
# is never handed to another test of this run, nor to a parallel worker, nor to a `lig up
# --free-ports` the tests start, and lies below the ephemeral range, where the stack's own
# outgoing connections cannot take it before its server binds it.
LEASES = PortLeases()


def free_port() -> int:
    """A free TCP port on 127.0.0.1, leased to this test process (never handed out twice)."""
    return LEASES.take()


def free_port_range(count: int) -> int:
    """The first of ``count`` consecutive free ports on 127.0.0.1, leased like
    :func:`free_port`."""
    return LEASES.take_consecutive(count)


def wait_for_port(port: int, timeout: float = 10.0, host: str = "127.0.0.1") -> None:
    """Block until something accepts TCP connections on ``host:port``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s") from None
            time.sleep(0.02)
