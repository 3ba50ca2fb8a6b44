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



def interruptible_child() -> None:
    """``preexec_fn`` for a child a test sends SIGINT: :func:`die_with_parent`, and SIGINT back
    to its default disposition.

    A suite started in the background without job control (``make test &`` from a script, some
    CI runners) inherits SIGINT ignored, and so does every child; Python then installs no
    KeyboardInterrupt handler, and the child never sees the test's Ctrl-C.
    """
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
