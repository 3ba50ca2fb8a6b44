"""The installed ``lig`` (``pip install .``: the image, an editable venv) carries every package
of the repository: a package missing from ``[tool.setuptools.packages.find]`` imports from a
checkout (the tests' PYTHONPATH) but not once installed, where ``lig bench``, ``lig record``
and ``lig replay`` would fail with ModuleNotFoundError."""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_packages

REPO = Path(__file__).resolve().parents[1]
NOT_SHIPPED = {"tests"}  # the test suite runs from a checkout


def test_every_top_level_package_is_in_the_wheel() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = set(find_packages(where=str(REPO), include=include))
    top_level = {path.parent.name for path in REPO.glob("*/__init__.py")} - NOT_SHIPPED
    assert top_level - shipped == set()
    # Their subpackages too: an include pattern without "*" ships the package alone.
    nested = {".".join(path.parent.relative_to(REPO).parts)
              for package in top_level for path in (REPO / package).rglob("__init__.py")}
    assert nested - shipped == set()
