"""Leased loopback ports (lig/port_leases.py): below the ephemeral range, never handed out twice,
never to two processes at once, released when the holder dies however it dies."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lig.port_leases import (
    BLOCK,
    FLOOR,
    NoFreePorts,
    PortLeases,
    bindable,
    ephemeral_start,
    leased_range,
)
from tests.support.ports import LEASES
from tests.support.processes import die_with_parent


def small_range(blocks: int = 4) -> range:
    """Whole blocks leased to this test process (so no parallel test listens there), for
    leases of the test's own in a folder of its own."""
    start = LEASES.take_consecutive(blocks * BLOCK)
    return range(start, start + blocks * BLOCK)


def test_the_range_ends_where_the_kernel_starts_outgoing_ports(tmp_path: Path) -> None:
    assert leased_range().stop <= ephemeral_start()
    assert leased_range(32768) == range(FLOOR, FLOOR + (32768 - FLOOR) // BLOCK * BLOCK)
    # A machine that gives outgoing connections almost every port still gets a range.
    assert leased_range(1024).start == FLOOR and len(leased_range(1024)) > 16 * BLOCK
    weird = tmp_path / "ip_local_port_range"
    weird.write_text("garbage\n")
    assert ephemeral_start(weird) == 32768


def test_outgoing_connections_never_get_a_leasable_port() -> None:
    """The race this module exists for: a port found free by binding port 0 is an ephemeral
    port, which the stack's own outgoing connections also draw from; leased ones never are."""
    leasable = leased_range()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(300)
        assert server.getsockname()[1] not in leasable  # bind(0) draws from the ephemeral range
        clients = [socket.create_connection(server.getsockname()) for _ in range(200)]
        try:
            local_ports = {client.getsockname()[1] for client in clients}
        finally:
            for client in clients:
                client.close()
    assert len(local_ports) == 200
    assert not local_ports & set(leasable)


def test_two_holders_never_share_a_port_and_each_hands_a_port_out_once(tmp_path: Path) -> None:
    ports = small_range(4)
    with PortLeases(ports, tmp_path, random.Random(1)) as one, \
            PortLeases(ports, tmp_path, random.Random(1)) as other:
        mine = [one.take() for _ in range(BLOCK + 5)]  # into a second block
        theirs = [other.take() for _ in range(BLOCK + 5)]
    assert len(set(mine)) == len(mine) and len(set(theirs)) == len(theirs)
    assert not set(mine) & set(theirs)
    assert all(port in ports for port in mine + theirs)


def test_consecutive_ports_skip_what_must_be_avoided_and_busy_ports(tmp_path: Path) -> None:
    ports = small_range(6)
    with PortLeases(ports, tmp_path, random.Random(3)) as leases:
        leases.avoid(range(ports.start, ports.start + 2 * BLOCK))
        first = leases.take_consecutive(BLOCK + 1)  # two adjacent blocks of their own
        taken = range(first, first + BLOCK + 1)
        assert first >= ports.start + 2 * BLOCK and taken.stop <= ports.stop
        assert all(bindable(port) for port in taken)
        assert first not in [leases.take() for _ in range(3)]


def test_a_listener_outside_any_lease_is_skipped(tmp_path: Path) -> None:
    ports = small_range(1)
    with socket.socket() as squatter:
        # As servers do: the block may have been leased (and its ports used) before, and an
        # earlier connection lingering in TIME_WAIT does not keep a server from binding.
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", ports.start))
        squatter.listen()
        with PortLeases(ports, tmp_path) as leases:
            handed = {leases.take() for _ in range(BLOCK - 1)}
            assert ports.start not in handed
            with pytest.raises(NoFreePorts):
                leases.take()


def test_released_leases_go_to_the_next_holder(tmp_path: Path) -> None:
    ports = small_range(1)
    with PortLeases(ports, tmp_path) as first:
        first.take()
        with pytest.raises(NoFreePorts, match="leased or in use"):
            PortLeases(ports, tmp_path).take()
    with PortLeases(ports, tmp_path) as second:
        assert second.take() in ports


def test_a_killed_holder_leaves_its_blocks_to_others(tmp_path: Path) -> None:
    ports = small_range(1)
    code = ("import sys; from pathlib import Path; from lig.port_leases import PortLeases; "
            f"leases = PortLeases(range({ports.start}, {ports.stop}), Path({str(tmp_path)!r})); "
            "leases.take(); print('held', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(NoFreePorts):
            PortLeases(ports, tmp_path).take()
    finally:
        holder.kill()
        holder.wait()
    with PortLeases(ports, tmp_path) as leases:
        assert leases.take() in ports
