"""Code as it was at another git revision, for benchmarks that measure it beside today's."""

from __future__ import annotations

import importlib.util
import subprocess
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def module_at(rev: str, path: str, name: str) -> ModuleType:
    """The file ``path`` (relative to the repository) as it was at ``rev``, imported as the
    module ``name`` (it imports the rest of the tree as it is now)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"],
                            capture_output=True, check=True).stdout
    copy = Path(tempfile.mkdtemp(prefix=f"{name}-")) / f"{name}.py"
    copy.write_bytes(source)
    spec = importlib.util.spec_from_file_location(name, copy)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
