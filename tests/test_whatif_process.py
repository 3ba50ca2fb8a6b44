"""``lig replay --what-if`` as a process: Ctrl-C (SIGINT) during a long read ends it with one
line and exit 130, not a traceback."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.schemas import PolicyConfig
from tests.support.processes import die_with_parent
from tests.support.recorded_decisions import Spec, write

pytestmark = pytest.mark.timeout(90)


def test_sigint_ends_a_long_what_if_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "fleet.ligrec"
    write(path, Spec(decisions=20_000, policy=PolicyConfig("prefix-aware"), pods=16))
    process = subprocess.Popen(
        [sys.executable, "-m", "lig.cli", "replay", str(path), "--what-if", "--policies",
         "recorded,prefix-aware,filter-tree,least-queue,random,round-robin"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
    time.sleep(2.0)  # started and reading: the whole pass takes several seconds
    assert process.poll() is None, process.communicate()
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 130, err
    assert (out, err) == ("", "lig replay: interrupted\n")
