"""Why a service cannot start: the host's own errors (the root and exit codes:
:mod:`shared.errors`)."""

from __future__ import annotations

from shared.errors import LigError


class PortInUse(LigError):
    """A port the service must listen on cannot be bound."""

    def __init__(self, what: str, host: str, port: int, reason: object) -> None:
        super().__init__(f"cannot listen on {host}:{port} ({what}): {reason}")
        self.host = host
        self.port = port
