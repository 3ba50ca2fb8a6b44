"""What the tools read about local processes from /proc (Linux): resident memory, and which
process listens on a loopback port (to find an attached stack's picker)."""

from __future__ import annotations

import os
from pathlib import Path

_LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid``, or None if it is gone or unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time ``pid`` has used, or None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pid_listening_on(port: int) -> int | None:
    """The pid of the process listening on TCP ``port`` (IPv4), if this user can see it."""
    inodes = set()
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
            inodes.add(fields[9])
    if not inodes:
        return None
    targets = {f"socket:[{inode}]" for inode in inodes}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in targets:
                    return int(entry.name)
        except OSError:
            continue
    return None
