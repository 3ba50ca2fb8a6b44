"""``lig picker --workers N``: N picker processes sharing the gRPC ports through SO_REUSEPORT.

The kernel spreads *connections* over the workers (each Envoy worker thread holds its own
HTTP/2 connection to a picker), so N workers pay off with N or more Envoy threads or replicas.
Each worker is a whole picker (NATS, state, health); this supervisor only starts them, restarts
one that dies, serves their summed Prometheus metrics (prometheus-client multiprocess mode) and
stops them all within ~2 s of SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from multiprocessing.process import BaseProcess

log = logging.getLogger("lig.picker.workers")

RESTART_DELAY = 1.0  # seconds before a dead worker is replaced (no tight crash loop)
STOP_TIMEOUT = 3.0  # seconds the workers get after SIGTERM (drain delay + grace) before SIGKILL


def _worker(args: argparse.Namespace) -> None:
    """Entry point of one worker process (spawned: a fresh interpreter)."""
    from prometheus_client import CollectorRegistry

    from services.picker.main import serve
    from shared.logs import setup_logging
    from shared.service import run_service

    setup_logging("picker", args.log_level)
    # The exit code says why a worker ended (the supervisor logs it and restarts the worker).
    raise SystemExit(run_service(
        lambda stop: serve(args, stop, CollectorRegistry(), None, reuse_port=True)))


def supervise(args: argparse.Namespace) -> int:
    """Run ``args.workers`` pickers until SIGTERM/SIGINT; returns the exit code."""
    metrics_dir = tempfile.mkdtemp(prefix="lig-picker-metrics-")
    # Set before any worker starts: prometheus-client reads it when a worker imports it.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    stopping = threading.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: stopping.set())
    context = multiprocessing.get_context("spawn")

    def spawn() -> BaseProcess:
        process = context.Process(target=_worker, args=(args,), name="lig-picker-worker")
        process.start()
        return process

    workers = [spawn() for _ in range(args.workers)]
    http_server = None
    if args.metrics_port:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=metrics_dir)
        http_server, _ = start_http_server(args.metrics_port, args.host, registry)
    log.info("picker supervisor: %d workers (pids %s) on ports %d/%d, metrics on %s",
             len(workers), ", ".join(str(w.pid) for w in workers), args.grpc_port,
             args.health_port, f"{args.host}:{args.metrics_port}" if args.metrics_port
             else "(off)")
    try:
        while not stopping.wait(0.2):
            for index, worker in enumerate(workers):
                if worker.is_alive():
                    continue
                log.error("picker worker %s exited with %s; restarting it", worker.pid,
                          worker.exitcode)
                multiprocess.mark_process_dead(worker.pid, metrics_dir)
                if stopping.wait(RESTART_DELAY):
                    break
                workers[index] = spawn()
    finally:
        _stop(workers)
        if http_server is not None:
            http_server.shutdown()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


def _stop(workers: list[BaseProcess]) -> None:
    for worker in workers:
        if worker.is_alive() and worker.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            log.warning("picker worker %s did not stop in time; killing it", worker.pid)
            worker.kill()
            worker.join(1)
