"""Which pods to subscribe to, and on which ports: from the registry view and the port flags.

The events port is not in the registry: vLLM's is a server flag, usually the same for a whole
fleet (5557), so ``--events-port`` gives it, either absolute (``5557``) or relative to the pod's
serving port (``+1000``, ``-443``: for several pods on one host, as ``lig sim`` runs them).
"""

from __future__ import annotations

import msgspec

from services.collector.ownership import owner
from services.collector.targets import pod_key
from services.kvevents.pod_stream import PodEndpoints
from shared.registry_view import RegistryView


class PortSpec(msgspec.Struct, frozen=True):
    """A port, absolute or relative to the pod's serving port."""

    value: int
    relative: bool = False

    def port_for(self, serving_port: int) -> int:
        """The port on a pod serving on ``serving_port``."""
        return serving_port + self.value if self.relative else self.value

    def __str__(self) -> str:
        """As the flag takes it: ``5557`` or ``+1000``."""
        return f"{self.value:+d}" if self.relative else str(self.value)


def parse_port(text: str, flag: str) -> PortSpec:
    """``5557``, ``+N`` or ``-N``; ValueError names ``flag``."""
    relative = text[:1] in "+-" and len(text) > 1
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a port, +N or -N") from None
    if not relative and not 0 < value <= 65535:
        raise ValueError(f"{flag}: port {value} out of range")
    return PortSpec(value, relative)


def parse_ranks(text: str, flag: str, most: int) -> range:
    """``N`` (ranks 0..N-1) or ``A-B`` (ranks A..B, both included), at most ``most`` ranks;
    ValueError names ``flag``."""
    first, dash, last = text.strip().partition("-")
    try:
        ranks = range(int(first), int(last) + 1) if dash else range(int(first))
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not N or A-B") from None
    if not ranks or ranks.start < 0 or ranks.stop > 65536:
        raise ValueError(f"{flag}: {text!r} names no rank in 0..65535")
    if len(ranks) > most:
        raise ValueError(f"{flag}: {len(ranks)} ranks, at most {most}")
    return ranks


def parse_lora_ids(text: str, flag: str) -> dict[int, str]:
    """``ID=NAME,...`` as a map; ValueError names ``flag``."""
    names: dict[int, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        number, equals, name = item.partition("=")
        if not equals or not name.strip() or not number.strip().isdigit():
            raise ValueError(f"{flag}: {item!r} is not ID=NAME")
        names[int(number)] = name.strip()
    return names


def _tcp(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"tcp://{host}:{port}"


class Share(msgspec.Struct, frozen=True):
    """This replica (``me``) among the replicas sharing the pods (``members``, ``me``
    included): each pod goes to one of them by the collector's rendezvous hashing."""

    me: str = "0"
    members: frozenset[str] = frozenset({"0"})

    @classmethod
    def static(cls, shard: int, shards: int) -> Share:
        """Shard ``shard`` of ``shards`` numbered replicas (``--shard``/``--shards``)."""
        return cls(str(shard), frozenset(str(number) for number in range(shards)))

    def owns(self, key: str) -> bool:
        """Whether this replica follows the pod ``key``."""
        return len(self.members) <= 1 or owner(key, self.members | {self.me}) == self.me


ALONE = Share()  # one replica following every pod


def pods_from_view(view: RegistryView, events: PortSpec, replay: PortSpec | None,
                   share: Share = ALONE, ranks: range = range(1)) -> dict[str, PodEndpoints]:
    """Every data-parallel rank of every endpoint of every pool this replica owns (a pod's
    ranks stay together), by pod key and rank; rank ``r`` of ``ranks`` (global ranks) uses
    the ports + ``r``, as vLLM does. Ranks whose ports fall outside 1..65535 are left out."""
    pods: dict[str, PodEndpoints] = {}
    for pool, endpoint_set in view.endpoints.items():
        for endpoint in endpoint_set.endpoints:
            key = pod_key(pool, endpoint.name)
            if not share.owns(key):
                continue
            for rank in ranks:
                port = events.port_for(endpoint.port) + rank
                replay_port = replay.port_for(endpoint.port) + rank \
                    if replay is not None else None
                if not 0 < port <= 65535 or (replay_port is not None
                                             and not 0 < replay_port <= 65535):
                    continue
                pods[f"{key}#{rank}"] = PodEndpoints(
                    pool=pool, pod=endpoint.name, address=endpoint.hostport,
                    events=_tcp(endpoint.address, port),
                    replay=None if replay_port is None else _tcp(endpoint.address, replay_port),
                    dp_rank=rank)
    return pods
