"""``lig`` commands whose output is piped into a reader that stops early (``| head``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "explain"


def test_a_closed_pipe_ends_a_command_without_a_traceback() -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes a line
    with os.fdopen(write, "wb") as stdout:
        done = subprocess.run(
            [sys.executable, "-m", "lig.cli", "explain", "--pods", str(EXAMPLES / "pods.json"),
             "--request", str(EXAMPLES / "request.json")],
            stdout=stdout, stderr=subprocess.PIPE, timeout=60, check=False,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 1
    assert b"Traceback" not in done.stderr and b"BrokenPipeError" not in done.stderr, done.stderr
