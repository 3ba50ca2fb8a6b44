"""``lig picker --workers N``: N picker processes sharing the gRPC ports through SO_REUSEPORT.

The kernel spreads *connections* over the workers (each Envoy worker thread holds its own
HTTP/2 connection to a picker), so N workers pay off with N or more Envoy threads or replicas.
Each worker is a whole picker (NATS, state, health); this supervisor only starts them, restarts
one that dies, serves their summed Prometheus metrics (prometheus-client multiprocess mode) and
stops them all once they have drained (``--drain-delay``) after SIGTERM, killing a worker only
when it overstays that by the picker's bounded stop margin.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from multiprocessing.process import BaseProcess

from prometheus_client import CollectorRegistry

from services.picker.app import serve, stop_timeout, tune_process
from services.picker.settings import PickerSettings
from shared.errors import LigError
from shared.host.metrics_http import MetricsServer
from shared.logs import setup_logging
from shared.service import run_service

log = logging.getLogger("lig.picker.workers")

RESTART_DELAY = 1.0  # seconds before a dead worker is replaced (no tight crash loop)


def _worker(settings: PickerSettings) -> None:
    """Entry point of one worker process (spawned: a fresh interpreter)."""
    setup_logging("picker", settings.log_level)
    tune_process()
    try:
        code = run_service(lambda stop: serve(settings, stop, CollectorRegistry(), None,
                                              reuse_port=True, on_started=gc.freeze))
    except LigError as error:
        log.error("picker worker: %s", error)
        code = error.exit_code
    # The exit code says why a worker ended (the supervisor logs it and restarts the worker).
    raise SystemExit(code)


def supervise(settings: PickerSettings) -> int:
    """Run ``settings.workers`` pickers until SIGTERM/SIGINT; returns the exit code."""
    metrics_dir = tempfile.mkdtemp(prefix="lig-picker-metrics-")
    # Set before any worker starts: prometheus-client reads it when a worker imports it.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    from prometheus_client import multiprocess

    stopping = threading.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: stopping.set())
    context = multiprocessing.get_context("spawn")

    def spawn() -> BaseProcess:
        process = context.Process(target=_worker, args=(settings,), name="lig-picker-worker")
        process.start()
        return process

    metrics_server = None
    if settings.metrics_port:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=metrics_dir)
        try:
            metrics_server = MetricsServer.start(settings.host, settings.metrics_port, registry)
        except LigError:
            shutil.rmtree(metrics_dir, ignore_errors=True)
            raise
    workers = [spawn() for _ in range(settings.workers)]
    log.info("picker supervisor: %d workers (pids %s) on ports %d/%d, metrics on %s",
             len(workers), ", ".join(str(w.pid) for w in workers), settings.grpc_port,
             settings.health_port, f"{settings.host}:{settings.metrics_port}"
             if settings.metrics_port else "(off)")
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
        _stop(workers, stop_timeout(settings))
        if metrics_server is not None:
            metrics_server.stop()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


def _stop(workers: list[BaseProcess], timeout: float) -> None:
    """SIGTERM every worker; SIGKILL one still running ``timeout`` seconds later."""
    for worker in workers:
        if worker.is_alive() and worker.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            log.warning("picker worker %s did not stop in time; killing it", worker.pid)
            worker.kill()
            worker.join(1)
