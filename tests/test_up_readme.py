"""The README a newcomer follows, and the reference beside it: a front page that fits on three
screens, a generated reference that is current, and links and paths that exist."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

from lig.cli import COMMANDS

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
REFERENCE = (REPO / "docs" / "reference.md").read_text()
DOCS = sorted((REPO / "docs").glob("*.md"))


def test_the_readme_is_a_front_page() -> None:
    assert len(README.splitlines()) <= 250
    for heading in ("## Quickstart", "## What you see", "## Documentation"):
        assert heading in README


def test_generated_reference_matches_the_code() -> None:
    render = runpy.run_path(str(REPO / "docs" / "render_reference.py"))["render"]
    assert render(REFERENCE) == REFERENCE, (
        "docs/reference.md is out of date: run python docs/render_reference.py")


def test_every_command_is_documented_with_its_help() -> None:
    for command in COMMANDS:
        assert f"#### `lig {command}`\n\n```text\nusage: lig {command} " in REFERENCE


def test_quickstart_targets_links_and_paths_exist() -> None:
    makefile = (REPO / "Makefile").read_text()
    for target in ("up", "test"):
        assert re.search(rf"^{target}:", makefile, re.MULTILINE), target
    for link in re.findall(r"\]\(([^)#]+)\)", README):
        if not link.startswith("http"):
            assert (REPO / link).exists(), link
    for path in re.findall(r"`((?:deploy|examples|docs|tests)/[\w./-]+)`", README):
        assert (REPO / path.rstrip("/")).exists(), path


@pytest.mark.parametrize("doc", DOCS, ids=[doc.name for doc in DOCS])
def test_links_between_the_docs_exist(doc: Path) -> None:
    for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
        if not link.startswith(("http://", "https://", "mailto:")):
            assert (doc.parent / link).exists(), f"{doc.name}: {link}"
