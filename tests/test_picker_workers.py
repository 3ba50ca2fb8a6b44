"""``lig picker --workers N`` on SIGTERM: every worker drains for ``--drain-delay`` and exits by
itself; the supervisor waits for that instead of killing workers mid-drain (issue 12)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

from tests.support.fleet_feed import FleetFeed
from tests.support.nats_server import NatsServer
from tests.support.picker import PickerProcess
from tests.support.waiting import wait_until

POOL = "pool-workers"
DRAIN_DELAY = 2.5  # with the 0.5 s grace for open streams, past the old fixed 3 s


def test_workers_drain_for_the_drain_delay_and_exit_by_themselves(
        nats_server: NatsServer, picker_process: Callable[..., PickerProcess]) -> None:
    feed = FleetFeed(nats_server.url, POOL).start()
    try:
        feed.set_pool()
        feed.set_endpoints({"pod-0": "127.0.0.1:9"})
        feed.set_metrics("pod-0", "127.0.0.1:9", waiting=0, running=1, kv_cache_usage=0.1)
        picker = picker_process(POOL, nats_server.url, extra_args=(
            "--workers", "2", "--drain-delay", str(DRAIN_DELAY)))
        picker.wait_ready()
        # Only a worker that became ready drains: wait until both say so.
        wait_until(lambda: picker.log().count("picker ready") == 2, within=15,
                   what="both workers ready")
        # Envoy keeps its ext_proc streams open: the workers' shutdown grace applies to them.
        with _open_streams(picker.grpc_port, count=6):
            started = time.monotonic()
            picker.signal(signal.SIGTERM)
            assert picker.wait(DRAIN_DELAY + 8) == 0
            elapsed = time.monotonic() - started
        log = picker.log()
        assert log.count(f"serving {DRAIN_DELAY:.1f}s more") == 2, log
        assert "did not stop in time" not in log, log
        assert DRAIN_DELAY <= elapsed < DRAIN_DELAY + 4, elapsed
    finally:
        feed.stop()


@contextmanager
def _open_streams(port: int, count: int) -> Iterator[None]:
    """``count`` ext_proc streams on separate connections (the kernel spreads them over the
    workers), each answered once and then left open until the block ends."""
    done = threading.Event()
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}",
                                      options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(count)]

    def requests() -> Iterator[pb.ProcessingRequest]:
        yield pb.ProcessingRequest(request_headers=pb.HttpHeaders(end_of_stream=True))
        done.wait(30)

    streams = [external_processor_pb2_grpc.ExternalProcessorStub(channel).Process(
        requests(), timeout=30) for channel in channels]
    for stream in streams:
        next(stream)  # answered: the stream is open on a worker
    try:
        yield
    finally:
        done.set()
        for channel in channels:
            channel.close()
