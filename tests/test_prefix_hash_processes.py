"""Prefix hashes are the same in every process: picker replicas (and the benchmark) share them,
so they must not depend on Python's per-process hash salt."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from scheduling.prefix_hash import prefix_hashes
from tests.test_scheduling_prompt import LONG

ROOT = Path(__file__).resolve().parents[1]


def test_hashes_are_the_same_in_another_process() -> None:
    """Replicas share hashes: no per-process salt (PYTHONHASHSEED differs on purpose)."""
    code = ("from scheduling.prefix_hash import prefix_hashes; "
            f"print(list(prefix_hashes(({LONG!r}).encode(), 'm')))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)},
                           timeout=60)
    assert other.stdout.strip() == str(list(prefix_hashes(LONG.encode(), "m")))
