"""NATS subject and JetStream key names, with reversible escaping of name tokens.

Pod, pool and model names come from users and Kubernetes; a ``.`` would split a subject token,
``*``/``>`` are wildcards and spaces are illegal. JetStream KV keys are stricter still
(``[-/_=.a-zA-Z0-9]``), so one escaping serves both: every byte outside ``[-/_a-zA-Z0-9]`` becomes
``=XX`` (upper-case hex of its UTF-8 bytes), ``=`` included, which makes it reversible.
"""

from __future__ import annotations

import re

from msgspec import Struct

DEFAULT_PREFIX = "lig"

_SAFE = frozenset(b"-/_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_ESCAPED = re.compile(r"=([0-9A-F]{2})")


def escape_token(name: str) -> str:
    """Map any name to one subject/KV-key token; :func:`unescape_token` inverts it."""
    if not name:
        raise ValueError("a name used in a subject must not be empty")
    raw = name.encode()
    if all(b in _SAFE for b in raw):
        return name
    return "".join(chr(b) if b in _SAFE else f"={b:02X}" for b in raw)


def unescape_token(token: str) -> str:
    """Invert :func:`escape_token`."""
    if "=" not in token:
        return token
    out = bytearray()
    pos = 0
    for match in _ESCAPED.finditer(token):
        out += token[pos : match.start()].encode()
        out.append(int(match.group(1), 16))
        pos = match.end()
    out += token[pos:].encode()
    return out.decode()


class Subjects(Struct, frozen=True):
    """Subject names under one prefix (``lig`` unless configured)."""

    prefix: str = DEFAULT_PREFIX

    @property
    def registry_bucket(self) -> str:
        """JetStream KV bucket holding pools, models and endpoint sets (``lig-registry``)."""
        return f"{self.prefix.replace('.', '-')}-registry"

    @property
    def metrics_stream(self) -> str:
        """JetStream stream recording snapshots for replay (``LIG_METRICS``)."""
        return f"{self.prefix.replace('.', '_').upper()}_METRICS"

    @property
    def decisions_stream(self) -> str:
        """JetStream stream recording the pickers' decisions (``LIG_DECISIONS``)."""
        return f"{self.prefix.replace('.', '_').upper()}_DECISIONS"

    @property
    def registry_stream(self) -> str:
        """JetStream stream recording every registry change (``LIG_REGISTRY``), sourced from
        the registry bucket's own stream."""
        return f"{self.prefix.replace('.', '_').upper()}_REGISTRY"

    def metrics(self, pool: str, pod: str) -> str:
        """Where one pod's snapshots are published."""
        return f"{self.prefix}.metrics.{escape_token(pool)}.{escape_token(pod)}"

    def pool_metrics(self, pool: str) -> str:
        """Wildcard over every pod of a pool."""
        return f"{self.prefix}.metrics.{escape_token(pool)}.>"

    def all_metrics(self) -> str:
        """Wildcard over every snapshot (the recording stream's subjects)."""
        return f"{self.prefix}.metrics.>"

    @property
    def kv_blocks_stream(self) -> str:
        """JetStream stream recording the pods' KV block-set changes (``LIG_KVBLOCKS``)."""
        return f"{self.prefix.replace('.', '_').upper()}_KVBLOCKS"

    def kv_blocks(self, pool: str, pod: str) -> str:
        """Where one pod's KV block-set changes are published (``lig kv-events``)."""
        return f"{self.prefix}.kvblocks.{escape_token(pool)}.{escape_token(pod)}"

    def pool_kv_blocks(self, pool: str) -> str:
        """Wildcard over every pod of a pool's KV block-set changes."""
        return f"{self.prefix}.kvblocks.{escape_token(pool)}.>"

    def all_kv_blocks(self) -> str:
        """Wildcard over every pod's KV block-set changes."""
        return f"{self.prefix}.kvblocks.>"

    def collector_heartbeat(self, collector_id: str) -> str:
        """Where a collector announces itself for work sharing."""
        return f"{self.prefix}.collectors.{escape_token(collector_id)}"

    def all_collector_heartbeats(self) -> str:
        """Wildcard over every collector's heartbeats."""
        return f"{self.prefix}.collectors.*"

    def decisions(self, pool: str) -> str:
        """Where the pickers publish the decisions they made for ``pool``."""
        return f"{self.prefix}.decisions.{escape_token(pool)}"

    def all_decisions(self) -> str:
        """Wildcard over every pool's decisions (what a picker serving every pool follows, and
        what the decisions stream records)."""
        return f"{self.prefix}.decisions.*"

    def records(self, pool: str) -> str:
        """Where the pickers publish the decision records of ``pool`` (the flight recorder:
        ``scheduling/record.py``; not read by peers, only recorded)."""
        return f"{self.prefix}.records.{escape_token(pool)}"

    def all_records(self) -> str:
        """Wildcard over every pool's decision records."""
        return f"{self.prefix}.records.*"

    def parse_metrics(self, subject: str) -> tuple[str, str]:
        """``(pool, pod)`` from a metrics subject; ValueError if it is not one."""
        parts = subject.split(".")
        head = self.prefix.split(".")
        n = len(head)
        if len(parts) != n + 3 or parts[:n] != head or parts[n] != "metrics":
            raise ValueError(f"not a metrics subject: {subject!r}")
        return unescape_token(parts[-2]), unescape_token(parts[-1])


def pool_key(pool: str) -> str:
    """Registry KV key of an InferencePool."""
    return f"pool.{escape_token(pool)}"


def model_key(pool: str, model: str) -> str:
    """Registry KV key of an InferenceModel."""
    return f"model.{escape_token(pool)}.{escape_token(model)}"


def endpoints_key(pool: str) -> str:
    """Registry KV key of a pool's EndpointSet."""
    return f"endpoints.{escape_token(pool)}"
