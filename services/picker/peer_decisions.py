"""Peer pickers' decisions applied to this picker's pod tables, and forgotten when they go stale.

Every picker replica publishes what it decides (``services/picker/decision_stream.py``); this is
the receiving side without the network. A peer's routed request counts in the pod table exactly
as one of ours would: in flight until its finished event, and unreported until the pod's next
snapshot (which clears peers' and own counts alike), with the prompt tokens the peer expects the
pod to prefill (``RoutedEvent.prefill_tokens``; all its prompt tokens from a peer that does not
send them); its prompt's block hashes go into the pool's prefix index as if this picker had
routed it. Batches carrying our own picker id are ignored: our requests were counted when we
routed them.

Nothing here is persisted, and nothing a peer said outlives a bounded time:

- a peer silent for longer than ``SILENCE_HEARTBEATS`` of its heartbeat intervals (it sends an
  empty batch at least that often; ``MIN_SILENCE`` at the least) is gone (killed, partitioned,
  restarted under a new id): every request it still had in flight here is finished;
- a single request counted in flight for longer than ``request_ttl`` is finished, so that a lost
  finished event (a batch dropped while NATS was away) leaves no phantom load forever.

Unreported counts need no expiry of their own: the pod's next snapshot clears them (those
routed before its scrape began; a peer's request counts as routed when its batch was sent).

Each batch also tells how late peers' decisions arrive (its send time against this picker's
wall clock): the table's ``peer_lag`` is the largest of its live peers' recent lags (a moving
average), and its ``peer_unseen`` the sum over live peers of their routing rate (a moving
average over about a second) times their lag: how many decisions of others are probably in no
count yet, which the default policy reads (``scheduling/plugins/least_work.py``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from services.picker.routing import Router
from services.picker.state import PodTable
from shared.schemas import DecisionBatch, FinishedEvent, RoutedEvent

SILENCE_HEARTBEATS = 4  # heartbeats a peer may miss before its contributions are dropped
MIN_SILENCE = 0.5  # seconds: the shortest silence that drops a peer, whatever it announces
DEFAULT_REQUEST_TTL = 600.0  # seconds a peer's request may stay in flight without finishing
LAG_WEIGHT = 0.1  # weight of a batch's lag in a peer's moving average (about 10 batches)
RATE_TAU = 1.0  # seconds over which a peer's routing rate is averaged


class _Peer:
    """What one peer picker contributed to one pool's table: its requests still in flight."""

    __slots__ = ("deadline", "heard", "lag", "rate", "requests", "silence", "table")

    def __init__(self, table: PodTable) -> None:
        self.table = table
        # request id -> (pod, when applied here), oldest first (dicts keep insertion order).
        self.requests: dict[int, tuple[str, float]] = {}
        self.silence = MIN_SILENCE
        self.deadline = 0.0
        self.lag = 0.0  # seconds from its batches' send to their apply here (moving average)
        self.rate = 0.0  # routed events per second (moving average over RATE_TAU)
        self.heard = 0.0  # when the rate was last updated

    def finish_all(self) -> int:
        """Finish every request still counted; how many there were."""
        table = self.table
        for pod, _ in self.requests.values():
            table.peer_finished(pod)
        count = len(self.requests)
        self.requests.clear()
        return count


class PeerDecisions:
    """Applies peers' :class:`DecisionBatch` es to the pools' routers (``router_of(pool)``, None
    for a pool not served): their pod tables and prefix indexes; and expires what they
    contributed to the tables (see the module doc)."""

    def __init__(self, picker_id: str, router_of: Callable[[str], Router | None],
                 clock: Callable[[], float] = time.monotonic,
                 request_ttl: float = DEFAULT_REQUEST_TTL) -> None:
        self.picker_id = picker_id
        self._router_of = router_of
        self._clock = clock
        self.request_ttl = request_ttl
        self._peers: dict[tuple[str, str], _Peer] = {}  # (picker id, pool) -> contributions
        self.applied = 0  # events applied
        self.own = 0  # batches of our own that came back (NATS echoes them)
        self.not_served = 0  # batches for a pool this picker does not serve
        self.expired = 0  # requests finished by expiry instead of a finished event
        self.unknown_pod = 0  # routed events naming a pod that is no member here (yet)

    def apply(self, batch: DecisionBatch) -> None:
        """Count ``batch``'s routed and finished requests in its pool's table."""
        picker = batch.picker
        if picker == self.picker_id:
            self.own += 1
            return
        router = self._router_of(batch.pool)
        if router is None:
            self.not_served += 1
            return
        table = router.pods
        prefixes = router.prefixes
        key = (picker, batch.pool)
        peer = self._peers.get(key)
        if peer is None or peer.table is not table:
            if peer is not None:  # the pool's table was rebuilt: old counts went with it
                peer.requests.clear()
            peer = self._peers[key] = _Peer(table)
        now = self._clock()
        peer.silence = max(MIN_SILENCE, SILENCE_HEARTBEATS * batch.heartbeat_s)
        peer.deadline = now + peer.silence
        requests = peer.requests
        lag = table.age_of(batch.sent_at_ns)
        if batch.events:  # a heartbeat may be sent late by an idle event loop: not a decision
            peer.lag += LAG_WEIGHT * (lag - peer.lag) if peer.lag else lag
        routed = sum(1 for event in batch.events if isinstance(event, RoutedEvent))
        peer.rate = (peer.rate * math.exp((peer.heard - now) / RATE_TAU) if peer.heard else 0.0
                     ) + routed / RATE_TAU
        peer.heard = now
        self._update_lag(table)
        for event in batch.events:
            if isinstance(event, RoutedEvent):
                if event.request_id in requests:  # a repeat (moved to a fallback pod)
                    table.peer_finished(requests.pop(event.request_id)[0])
                prefill = event.prefill_tokens
                if table.peer_started(event.pod, event.prompt_tokens if prefill is None
                                      else prefill, lag):
                    requests[event.request_id] = (event.pod, now)
                    if event.prefix_hashes:
                        prefixes.record(event.pod, event.prefix_hashes)
                else:
                    self.unknown_pod += 1
            elif isinstance(event, FinishedEvent):
                entry = requests.pop(event.request_id, None)
                if entry is not None:  # else routed before we listened, or already expired
                    table.peer_finished(entry[0])
        self.applied += len(batch.events)

    def expire(self) -> int:
        """Drop silent peers' contributions and requests past their TTL; how many requests
        were finished this way."""
        now = self._clock()
        oldest = now - self.request_ttl
        expired = 0
        for key, peer in list(self._peers.items()):
            if now > peer.deadline:
                expired += peer.finish_all()
                del self._peers[key]
                self._update_lag(peer.table)
                continue
            requests = peer.requests
            while requests:
                request_id, (pod, applied_at) = next(iter(requests.items()))
                if applied_at >= oldest:
                    break
                del requests[request_id]
                peer.table.peer_finished(pod)
                expired += 1
        self.expired += expired
        return expired

    def _update_lag(self, table: PodTable) -> None:
        """``table.peer_lag``: the largest lag of the live peers that count in ``table``;
        ``table.peer_unseen``: their decisions within their lags, by their rates."""
        peers = [peer for peer in self._peers.values() if peer.table is table]
        table.peer_lag = max((peer.lag for peer in peers), default=0.0)
        table.peer_unseen = sum(peer.rate * peer.lag for peer in peers)

    def peers(self) -> int:
        """Peer pickers heard from recently (over every pool)."""
        return len({picker for picker, _ in self._peers})

    def in_flight(self) -> int:
        """Peers' requests counted in flight now (over every pool)."""
        return sum(len(peer.requests) for peer in self._peers.values())
