"""Figures measured by the attack and chaos tools, and the table they are printed as."""

from __future__ import annotations

import msgspec


class Figure(msgspec.Struct, frozen=True):
    """One measured value and, when it has one, the target it must meet.

    ``passed`` is None for a figure shown for context only (no target).
    """

    scenario: str
    name: str
    value: str
    target: str = ""
    passed: bool | None = None


def verdict(figure: Figure) -> str:
    """PASS, MISS, or blank for a figure without a target."""
    if figure.passed is None:
        return ""
    return "PASS" if figure.passed else "MISS"


def table(figures: list[Figure]) -> str:
    """The figures as an aligned plain-text table."""
    rows = [("scenario", "figure", "value", "target", "")]
    rows += [(f.scenario, f.name, f.value, f.target, verdict(f)) for f in figures]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
             .rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def all_passed(figures: list[Figure]) -> bool:
    """No figure missed its target."""
    return all(f.passed is not False for f in figures)
