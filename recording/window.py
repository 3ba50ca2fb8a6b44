"""The time window of an export: ``--since 10m`` or ``--from T --to T``."""

from __future__ import annotations

import datetime
import re

import msgspec

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class Window(msgspec.Struct, frozen=True):
    """``(from_ns, to_ns]`` in unix nanoseconds."""

    from_ns: int
    to_ns: int


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``10m``, ``1.5h``, ``2d``; ValueError otherwise."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"not a duration: {text!r} (examples: 90s, 10m, 1h)")
    return float(match.group(1)) * _UNIT_S[match.group(2) or "s"]


def parse_time(text: str) -> int:
    """Unix nanoseconds from ISO 8601 (``2026-12-01T14:03:00Z``; no zone means UTC) or unix
    seconds; ValueError otherwise."""
    try:
        return int(float(text) * 1e9)
    except ValueError:
        pass
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"not a time: {text!r} (ISO 8601 or unix seconds)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return int(moment.timestamp() * 1e9)


def window_from(since: str | None, start: str | None, end: str | None, now_ns: int) -> Window:
    """The window the flags describe (default: the last 10 minutes); ValueError if they
    conflict or the window is empty."""
    if since is not None and (start is not None or end is not None):
        raise ValueError("--since cannot be combined with --from/--to")
    if start is None:
        to_ns = now_ns if end is None else parse_time(end)
        window = Window(to_ns - int(parse_duration(since or "10m") * 1e9), to_ns)
    else:
        window = Window(parse_time(start), now_ns if end is None else parse_time(end))
    if window.to_ns <= window.from_ns:
        raise ValueError("the window is empty: --to must be after --from")
    return window


def format_time(time_ns: int) -> str:
    """``2026-12-01T14:03:00.123Z``: unix nanoseconds as UTC ISO 8601, to the millisecond."""
    moment = datetime.datetime.fromtimestamp(time_ns / 1e9, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def format_duration(seconds: float) -> str:
    """``0.4s``, ``42s``, ``9m12s``, ``1h02m05s``: a span for a human, to the second from 10 s
    up (the inverse of :func:`parse_duration` for whole seconds)."""
    if seconds < 10:
        return f"{seconds:.1f}s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
