"""Why a service cannot start or run: exception types, not ``SystemExit``.

Only the command-line layer (:func:`lig.cli.main`, or a worker process's entry point) turns
them into a one-line message and the exit code below, so every service ends the same way.
"""

from __future__ import annotations


class ServiceError(Exception):
    """A service cannot go on; ``str(error)`` is the one line the operator sees."""

    exit_code = 1


class ConfigError(ServiceError, ValueError):
    """A flag or environment variable has an unusable value (the message names both)."""

    exit_code = 2


class PortInUse(ServiceError):
    """A port the service must listen on cannot be bound."""

    def __init__(self, what: str, host: str, port: int, reason: object) -> None:
        super().__init__(f"cannot listen on {host}:{port} ({what}): {reason}")
        self.host = host
        self.port = port
