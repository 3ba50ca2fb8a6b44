"""``lig picker``: the Envoy ext_proc endpoint picker of one or more pools, fed from NATS.

The process entry point: flags (:class:`~services.picker.settings.PickerSettings`), logging,
process-wide tuning, then the app (:func:`services.picker.app.serve`) on one event loop, or
``--workers N`` such processes on the same ports (:mod:`services.picker.workers`).
"""

from __future__ import annotations

import argparse
import gc

from prometheus_client import CollectorRegistry

from services.picker.app import serve, tune_process
from services.picker.core import load_tokenizers
from services.picker.settings import PickerSettings
from services.picker.tls import check_tls_files
from services.picker.workers import supervise
from shared.host.settings import add_flags, from_args
from shared.logs import setup_logging
from shared.service import run_service


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the picker's flags (one per :class:`PickerSettings` field)."""
    add_flags(parser, PickerSettings)


def settings_from(args: argparse.Namespace) -> PickerSettings:
    """Validated settings: flags, else ``LIG_*`` variables, else defaults; wrong TLS or
    tokenizer files fail here, before any worker starts."""
    settings: PickerSettings = from_args(PickerSettings, args)
    if settings.tls is not None:
        check_tls_files(settings.tls)
    # Loaded here only to fail (exit 2) before any worker starts; each process loads its own.
    load_tokenizers(settings)
    return settings


def run(args: argparse.Namespace) -> int:
    """Run the picker until SIGTERM/SIGINT."""
    settings = settings_from(args)
    setup_logging("picker", settings.log_level)
    if settings.workers > 1:
        return supervise(settings)
    tune_process()
    # Everything allocated once the servers listen lives as long as the process: keep it out
    # of the cyclic collector's scans, which otherwise run every few hundred requests.
    return run_service(lambda stop: serve(settings, stop, CollectorRegistry(),
                                          settings.metrics_port, on_started=gc.freeze))
