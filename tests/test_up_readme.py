"""The README a newcomer follows: its generated reference is current, its links and files exist."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

from lig.cli import COMMANDS

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_generated_reference_matches_the_code() -> None:
    render = runpy.run_path(str(REPO / "docs" / "render_readme.py"))["render"]
    assert render(README) == README, "README.md is out of date: run python docs/render_readme.py"


def test_every_command_is_documented_with_its_help() -> None:
    for command in COMMANDS:
        assert f"#### `lig {command}`\n\n```text\nusage: lig {command} " in README


def test_quickstart_targets_links_and_paths_exist() -> None:
    makefile = (REPO / "Makefile").read_text()
    for target in ("up", "test"):
        assert re.search(rf"^{target}:", makefile, re.MULTILINE), target
    for link in re.findall(r"\]\(([^)#]+)\)", README):
        if not link.startswith("http"):
            assert (REPO / link).exists(), link
    for path in re.findall(r"`((?:deploy|examples|docs|tests)/[\w./-]+)`", README):
        assert (REPO / path.rstrip("/")).exists(), path
