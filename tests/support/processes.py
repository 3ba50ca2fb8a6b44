"""Child processes of the test run that cannot outlive it."""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for Popen: SIGTERM the child when the test process dies (Linux only).

    A test run killed hard (timeout, CI cancel) otherwise leaves its servers running.
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

