"""The picker's life is its ext_proc listener's (issue 13, items 3 and 10): when the listener
stops by itself, health stops reporting SERVING and the process exits non-zero to be restarted;
a port that cannot be bound is one line and an exit code, not a traceback."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import hpack
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from protocols.http2 import END_HEADERS, END_STREAM, HEADERS, PREFACE, SETTINGS, frame
from services.picker.app import _BuiltinExtProc, _until_stopped_or_lost
from services.picker.ext_proc import Processor
from services.picker.observability import PickerMetrics
from services.picker.pools import Gateway
from services.picker.routing import Router
from services.picker.state import PodTable
from shared.errors import ExitCode
from tests.support.picker import PickerProcess
from tests.support.ports import free_port

SERVING = health_pb2.HealthCheckResponse.SERVING


def send_path(port: int, path: bytes) -> None:
    """One gRPC request with this raw ``:path`` over a fresh HTTP/2 connection."""
    block = hpack.Encoder().encode([
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", path),
        (b":authority", b"picker"), (b"content-type", b"application/grpc"), (b"te", b"trailers"),
    ])
    with socket.create_connection(("127.0.0.1", port), timeout=2) as connection:
        connection.sendall(PREFACE + frame(SETTINGS, 0, 0)
                           + frame(HEADERS, END_HEADERS | END_STREAM, 1, block))
        connection.settimeout(2)
        with contextlib.suppress(OSError):  # what the server answers (if anything) is not the point
            connection.recv(65536)


def wait_exit(picker: PickerProcess, within: float) -> tuple[int | None, list[int | None]]:
    """The exit code (None if still running after ``within`` s) and the liveness statuses seen."""
    statuses: list[int | None] = []
    deadline = time.monotonic() + within
    assert picker.process is not None
    while picker.process.poll() is None and time.monotonic() < deadline:
        statuses.append(picker.health("liveness"))
        # Sampled finely: the picker now exits within ~0.1 s of taking its health port down.
        time.sleep(0.01)
    return picker.process.poll(), statuses


def test_a_grpc_aio_listener_killed_by_one_request_takes_the_picker_down(
        nats_server, picker_process: Callable[..., PickerProcess]) -> None:  # type: ignore[no-untyped-def]
    picker = picker_process("pool-a", nats_server.url, extra_args=("--server", "grpc-aio"))
    deadline = time.monotonic() + 20
    while picker.health("liveness") != SERVING:
        assert time.monotonic() < deadline, picker.log()[-3000:]
        time.sleep(0.05)
    send_path(picker.grpc_port, b"/\xff")  # grpcio's serving loop fails and closes the port
    code, statuses = wait_exit(picker, within=10)
    assert code == ExitCode.EXT_PROC_LOST, (code, statuses, picker.log()[-3000:])
    assert statuses[-1:] != [SERVING]  # the last answer before the exit was not SERVING
    assert "the ext_proc server stopped (grpc.aio's serving loop failed" in picker.log()


def test_the_builtin_server_survives_the_same_request(
        nats_server, picker_process: Callable[..., PickerProcess]) -> None:  # type: ignore[no-untyped-def]
    picker = picker_process("pool-a", nats_server.url)
    deadline = time.monotonic() + 20
    while picker.health("liveness") != SERVING:
        assert time.monotonic() < deadline, picker.log()[-3000:]
        time.sleep(0.05)
    send_path(picker.grpc_port, b"/\xff")
    code, _ = wait_exit(picker, within=1.5)
    assert code is None
    assert picker.health("liveness") == SERVING


async def test_a_closed_builtin_listener_is_noticed() -> None:
    pods = PodTable(stale_after=1.0)
    processor = Processor(Gateway.serving(Router("pool-a", pods, random.Random(1))),
                          PickerMetrics(CollectorRegistry()), "x-gateway-destination-endpoint")
    ext_proc = _BuiltinExtProc(processor, "127.0.0.1", 0, False, None)
    await ext_proc.start()
    stop = asyncio.Event()
    watching = asyncio.create_task(_until_stopped_or_lost(stop, ext_proc))
    await asyncio.sleep(0.3)
    assert not watching.done()
    ext_proc._server._server.close()  # type: ignore[union-attr]  # as if the socket failed
    reason = await asyncio.wait_for(watching, 2)
    assert reason == "the built-in server's listening socket closed"
    await ext_proc.stop(0)
    stopped = asyncio.create_task(_until_stopped_or_lost(stop, ext_proc))
    stop.set()
    assert await asyncio.wait_for(stopped, 2) is None  # asked to stop: not a loss


@pytest.mark.parametrize("server", ["grpc-aio", "builtin"])
@pytest.mark.parametrize("busy", ["grpc", "health"])
def test_a_port_in_use_is_one_line_and_exit_code_1(server: str, busy: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        ports = {"grpc": free_port(), "health": free_port()}
        ports[busy] = taken
        result = subprocess.run(
            [sys.executable, "-m", "lig.cli", "picker", "--pool", "p", "--server", server,
             "--host", "127.0.0.1", "--grpc-port", str(ports["grpc"]),
             "--health-port", str(ports["health"]), "--metrics-port", "0",
             "--nats-url", "nats://127.0.0.1:1"],
            capture_output=True, text=True, timeout=30)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 1, output
    assert output.splitlines() == [f"lig picker: error: cannot listen on 127.0.0.1:{taken} "
                                   f"({'ext_proc' if busy == 'grpc' else busy}): "
                                   "[Errno 98] Address already in use"], output


@pytest.mark.parametrize("server", ["grpc-aio", "builtin"])
def test_a_picker_told_to_stop_is_no_loss_and_exits_0(
        server: str, nats_server, picker_process: Callable[..., PickerProcess]) -> None:  # type: ignore[no-untyped-def]
    picker = picker_process("pool-a", nats_server.url, extra_args=("--server", server))
    deadline = time.monotonic() + 20
    while picker.health("liveness") != SERVING:
        assert time.monotonic() < deadline, picker.log()[-3000:]
        time.sleep(0.05)
    picker.signal(signal.SIGTERM)
    assert picker.wait(5) == 0, picker.log()[-3000:]
    assert "ext_proc server stopped" not in picker.log()
