"""Log setup shared by the services: one line per event, service name first, UTC timestamps."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Annotated, Literal

from shared.host.settings import option

# The ``log_level`` field of every service's settings.
LogLevel = Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"],
                     option("log verbosity: DEBUG, INFO, WARNING or ERROR", parse=str.upper)]


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--log-level`` (default from ``LIG_LOG_LEVEL``, else INFO)."""
    parser.add_argument(
        "--log-level",
        default=os.environ.get("LIG_LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="log verbosity (env LIG_LOG_LEVEL)",
    )


def setup_logging(service: str, level: str = "INFO") -> None:
    """Send ``lig.*`` logs to stderr as ``time level service logger: message``."""
    formatter = logging.Formatter(
        f"%(asctime)s.%(msecs)03dZ %(levelname)s {service} %(name)s: %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
    )
    formatter.converter = time.gmtime
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class RateLimitedLog:
    """Log a recurring condition at most once per ``interval`` seconds; count the rest."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._logger = logger
        self._interval = interval
        self._last = float("-inf")
        self._suppressed = 0

    def warning(self, message: str, *args: object) -> None:
        """Log now, or count the event if the last line was less than ``interval`` ago."""
        now = time.monotonic()
        if now - self._last < self._interval:
            self._suppressed += 1
            return
        suffix = f" ({self._suppressed} similar suppressed)" if self._suppressed else ""
        self._logger.warning(message + suffix, *args)
        self._last = now
        self._suppressed = 0
