"""Which collectors are alive: heartbeats over NATS, and a live set that expires silent peers.

Each collector publishes a :class:`CollectorHeartbeat` every interval on
``<prefix>.collectors.<id>`` and listens to everyone else's. (``lig kv-events`` replicas share
their pods the same way, among themselves, on ``<prefix>.kvevents.<id>``: a
:class:`Membership` is one group of replicas on one subject.) A peer silent for 1.5 of its
intervals is dropped (checked every eighth of an interval), so a dead collector's pods move within
two intervals. A stopping collector says ``leaving`` and its pods move at once.

A new collector first listens for one interval without owning anything (``active=False``), and
peers answer a collector they have not seen with an immediate heartbeat. Peers count a collector
only once it is active, so a joiner takes over its share at the moment the others hand it over,
and no pod is scraped twice in the meantime.

While NATS is unreachable nothing is expired (silence then says nothing about the peers); after
a reconnect every peer gets a fresh grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
from collections.abc import Callable

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from shared.schemas import CollectorHeartbeat, DecodeError, decode, encode
from shared.waits import wait_set

log = logging.getLogger("lig.collector.membership")

EXPIRY_INTERVALS = 1.5
CHECKS_PER_INTERVAL = 8


def default_member_id() -> str:
    """A replica's name unless configured: host name and process id."""
    return f"{socket.gethostname()}-{os.getpid()}"


class HeartbeatSubjects(msgspec.Struct, frozen=True):
    """Where one group of replicas announces itself: ``of(id)`` for a replica, ``every`` the
    wildcard over the group."""

    of: Callable[[str], str]
    every: str


class Peer(msgspec.Struct):
    """What a collector knows of another."""

    active: bool
    expires_at: float
    interval_s: float


class LiveSet:
    """The peers a collector has heard from recently (pure state; time is passed in)."""

    def __init__(self, me: str) -> None:
        self.me = me
        self._peers: dict[str, Peer] = {}

    def heard(self, heartbeat: CollectorHeartbeat, now: float) -> tuple[bool, bool]:
        """Record a heartbeat; returns (the active members changed, the sender was unknown)."""
        peer_id = heartbeat.collector_id
        before = self._peers.get(peer_id)
        if heartbeat.leaving:
            self._peers.pop(peer_id, None)
            return before is not None and before.active, False
        # A nonsensical interval (NaN, negative) must not make a peer immortal.
        interval = heartbeat.interval_s if math.isfinite(heartbeat.interval_s) else 0.0
        interval = max(0.0, interval)
        self._peers[peer_id] = Peer(
            active=heartbeat.active,
            expires_at=now + EXPIRY_INTERVALS * interval,
            interval_s=interval,
        )
        was_active = before is not None and before.active
        return was_active != heartbeat.active, before is None

    def expire(self, now: float) -> list[str]:
        """Drop peers whose heartbeats stopped; returns the active ones dropped."""
        expired = [peer_id for peer_id, peer in self._peers.items() if peer.expires_at <= now]
        return [peer_id for peer_id in expired if self._peers.pop(peer_id).active]

    def grace(self, now: float) -> None:
        """Give every peer a fresh expiry (after a time in which we could not hear anyone)."""
        for peer in self._peers.values():
            peer.expires_at = now + EXPIRY_INTERVALS * peer.interval_s

    def members(self) -> frozenset[str]:
        """The active collectors, this one included."""
        return frozenset(peer_id for peer_id, p in self._peers.items() if p.active) | {self.me}


class Membership:
    """Announces this replica and tracks its peers; ``on_change`` runs when ownership may move,
    ``on_undecodable`` for each heartbeat skipped; ``role`` names the replicas in the logs.

    ``active`` turns true one interval after :meth:`run` starts; until then the replica must
    not work (it does not know its peers yet).
    """

    def __init__(
        self,
        nc: Client,
        subjects: HeartbeatSubjects,
        me: str,
        interval_s: float,
        on_change: Callable[[], None],
        on_undecodable: Callable[[], None] = lambda: None,
        role: str = "collector",
    ) -> None:
        self._nc = nc
        self._subjects = subjects
        self._interval_s = interval_s
        self._on_change = on_change
        self._on_undecodable = on_undecodable
        self._role = role
        self._live = LiveSet(me)
        self._connected = True
        self.active = False

    @property
    def me(self) -> str:
        return self._live.me

    def members(self) -> frozenset[str]:
        """The active collectors, this one included."""
        return self._live.members()

    async def run(self, stop: asyncio.Event) -> None:
        """Listen and announce until ``stop``; then announce that this collector leaves."""
        loop = asyncio.get_running_loop()
        subscription = await self._nc.subscribe(self._subjects.every, cb=self._received)
        try:
            await self._announce()
            settle_until = loop.time() + self._interval_s
            next_beat = settle_until
            while not stop.is_set():
                await wait_set(stop, self._interval_s / CHECKS_PER_INTERVAL)
                now = loop.time()
                if not self.active and now >= settle_until:
                    self.active = True
                    log.info("%s %s active; peers: %s", self._role, self.me,
                             sorted(self.members() - {self.me}) or "none")
                    await self._announce()
                    self._changed()
                if self._connected:
                    dead = self._live.expire(now)
                    if dead:
                        log.warning("%s %s stopped sending heartbeats; taking over",
                                    self._role, sorted(dead))
                        self._changed()
                if now >= next_beat:
                    await self._announce()
                    next_beat = max(next_beat + self._interval_s, now)
        finally:
            self.active = False
            await self._announce(leaving=True)
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()

    def disconnected(self) -> None:
        """NATS went away: stop expiring peers we cannot hear."""
        self._connected = False

    async def reconnected(self) -> None:
        """NATS is back: give peers a grace period and announce ourselves at once."""
        self._live.grace(asyncio.get_running_loop().time())
        self._connected = True
        await self._announce()

    async def _received(self, msg: Msg) -> None:
        try:
            heartbeat = decode(msg.data, CollectorHeartbeat)
        except DecodeError as exc:
            self._on_undecodable()
            log.warning("skipping undecodable heartbeat on %s: %s", msg.subject, exc)
            return
        if heartbeat.collector_id == self.me:
            return
        changed, unknown = self._live.heard(heartbeat, asyncio.get_running_loop().time())
        if heartbeat.leaving and changed:
            log.info("%s %s left; taking over its pods", self._role, heartbeat.collector_id)
        if unknown:
            log.info("%s %s joined (active=%s)", self._role, heartbeat.collector_id,
                     heartbeat.active)
            await self._announce()  # so that a joiner learns about us without waiting
        if changed:
            self._changed()

    def _changed(self) -> None:
        self._on_change()

    async def _announce(self, leaving: bool = False) -> None:
        if not self._nc.is_connected:
            return
        heartbeat = CollectorHeartbeat(collector_id=self.me, interval_s=self._interval_s,
                                       active=self.active, leaving=leaving)
        try:
            await self._nc.publish(self._subjects.of(self.me), encode(heartbeat))
        except Exception as exc:  # a lost heartbeat is retried next interval
            log.warning("heartbeat not sent: %s", exc)
