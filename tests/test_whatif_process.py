"""``lig replay --what-if`` as a process: Ctrl-C (SIGINT) during a long read ends it with one
line and exit 130, not a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shared.schemas import PolicyConfig
from tests.support.processes import interruptible_child
from tests.support.recorded_decisions import Spec, write

pytestmark = pytest.mark.timeout(90)
# Less than a pipe holds (64 KiB on Linux, 4 KiB at least by POSIX), more than the header.
PIPE_CHUNK = 4096


def test_sigint_ends_a_long_what_if_with_one_line(tmp_path: Path) -> None:
    """The recording comes through a pipe that is never finished, so the pass is still running
    whenever the signal comes (a fixed sleep raced a fast machine: the pass had ended). The
    child gets SIGINT's default back: started from a suite that runs in the background, it
    inherited SIGINT ignored and hung."""
    recording = tmp_path / "fleet.ligrec"
    write(recording, Spec(decisions=2_000, policy=PolicyConfig("prefix-aware"), pods=16))
    pipe = tmp_path / "pipe.ligrec"
    os.mkfifo(pipe)
    process = subprocess.Popen(
        [sys.executable, "-m", "lig.cli", "replay", str(pipe), "--what-if", "--policies",
         "recorded,prefix-aware,filter-tree,least-queue,random,round-robin"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=interruptible_child)
    try:
        # Opening the write end waits until the process opened the read end: it is reading.
        with pipe.open("wb", buffering=0) as feed:
            feed.write(recording.read_bytes()[:PIPE_CHUNK])  # fits the pipe: never blocks
            process.send_signal(signal.SIGINT)
            out, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert (out, err) == ("", "lig replay: interrupted\n")
