"""The precise prefix index: which pods hold which token-id blocks, from their KV-cache events.

``lig kv-events`` republishes every pod's vLLM KV-cache events on NATS as
:class:`~shared.kv_blocks.KVBlockChanges`; :meth:`PreciseIndex.apply` takes them one message at a
time. vLLM's own block hashes are salted per engine and cannot be recomputed from a prompt, so
each stored block is filed under the key of its token ids (:mod:`scheduling.token_blocks`): the
key of a ``BlockStored``'s first block is chained from the key of its ``parent_block_hash``
(looked up in the pod's engine-hash -> key map), or from :func:`~scheduling.token_blocks.root_key`
of its ``lora_name`` when it has no parent. A prompt's keys, computed the same way from the pool's
tokenizer, are then looked up by :meth:`PreciseIndex.match`.

What is kept, per pod:

- per data-parallel rank and KV-cache group, ``engine hash -> key`` (what ``BlockRemoved`` and
  the parents of later ``BlockStored`` events name) and the hashes in store order (for
  eviction). A rank is a cache of its own: ``AllBlocksCleared`` and resync markers clear the
  rank whose stream they came from, every group of it;
- KV-cache groups (hybrid models: full attention beside sliding-window or mamba layers) each
  announce the same block hashes for their own copy, and evict on their own: a sliding-window
  group drops blocks that left its window while the full-attention group keeps them. So each
  group's blocks are held apart, and a ``BlockRemoved`` of one group releases only that group's
  holding: the pod holds a block while any group of any rank does. A parent is looked up in its
  group, then in the rank's other groups (the keys are the tokens', the same in every group).
  The block size that prompts are cut by is taken from full-attention groups (or group 0 when
  the kind is not sent): a sliding-window group may use another. What this counts as a hit is
  what the full-attention group holds; when vLLM has dropped the sliding-window blocks at the
  end of that prefix it recomputes at most one window (docs/kv-events.md);
- the keys any of its ranks holds. A pod holds a block when one of its ranks does: vLLM's
  front end spreads a pod's requests over its ranks by load, not by prefix, so a match is the
  best case of the pod's ranks (documented in docs/kv-events.md);
- speculative keys, in generations of half the ttl: :meth:`PreciseIndex.speculate` counts a
  routed request's blocks as cached on the chosen pod at once, for ``speculative_ttl`` seconds
  (up to 1.5 times that), so that a burst of one prefix does not miss while the pod's events are
  on their way. Time is the caller's (``now``, or the index's ``clock``): virtual in a
  benchmark, so give ``match`` the same time as ``speculate``, or a ``clock``.

Skipped, counted by reason in :attr:`PreciseIndex.stats`: blocks whose parent is unknown to the
rank's map (``parent``: a prompt lookup, which starts at the root, could never reach them),
blocks stored without token ids (``no_tokens``) or with ids that are no 32-bit token ids
(``token_ids``), blocks of a size outside 1..4,096 tokens (``block_size``), and blocks of another
medium than the GPU cache (``medium``: vLLM's CPU offloading announces the same hashes again for
its own tier).

Knowing when it is wrong: every message of ``lig kv-events`` carries ``stream_seq``, numbered
without gaps per pod and rank. A message lost on the way (a gap in ``stream_seq``), a resync
marker (the bridge lost vLLM batches), a history that does not start at the stream's start, or
a block stored on a parent the index does not hold (the engine holds it: a prefix the index
missed, as after a resync while the prefix stays cached) marks the rank **incomplete** for
``recovery_s`` seconds from the last such cause:
:meth:`PreciseIndex.incomplete_pods` lists the pods with an incomplete rank, and the router scores
them from the approximate index as well (the better of the two counts). An engine restart (the
bridge's restart marker: ``AllBlocksCleared`` without ``resync``) empties the rank for real, which
makes it whole again at once.

Becoming right again: a cleared rank's ``engine hash -> key`` map is kept (``former``, bounded by
``max_blocks`` over all ranks) to look parents up, and only for that. vLLM's block hashes are
content hashes (chained, salted per engine process), so a hash that was a block's stays that
block's: blocks stored after a resync on top of a prefix cached before it are filed (counted as
``recovered``) instead of skipped for an unknown parent. A restarted engine's new hashes never
meet the old ones. A prefix cached before a resync and not stored again stays unknown until vLLM
announces it: at its next hit in vLLM's full report mode, or when it is evicted and recomputed.
Until then every block stored on top of it renews the rank's incomplete mark, so wholeness is
observed, not assumed once ``recovery_s`` has passed (docs/kv-events.md).

Hard memory bound: at most ``max_blocks`` (rank, engine hash) entries; beyond it the oldest
stored blocks of the rank holding the most are evicted (the engine's own eviction, announced by
``BlockRemoved``, normally keeps the index well under it). Speculative entries are bounded apart,
by ``max_speculative`` (the oldest generation dropped first). ``bench/bench_precise_index.py``
reports the bytes per block and the process's RSS at the bound.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from itertools import islice, takewhile

from scheduling.token_blocks import block_keys, root_key
from shared.kv_blocks import KVBlockChanges
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

DEFAULT_RECOVERY_S = 60.0
"""Seconds a rank counts as incomplete after a lost message or a resync: what vLLM needs to
announce again most of what it holds (evictions and recomputation under load; a prefix hit at
once in full report mode)."""
DEFAULT_SPECULATIVE_TTL = 3.0
"""Seconds a routed request's blocks count as cached on its pod before events confirm them: a
long prompt's prefill, behind a queue, takes about that long to show up as ``BlockStored``."""

# Engine hashes are filed as 60-bit ints: CPython stores those in 32 bytes, full 64-bit ones in
# 48 (bench/bench_precise_index.py); a collision within one rank's cache stays negligible.
_HASH_MASK = (1 << 60) - 1
_GPU = frozenset({None, "GPU", "gpu"})
_MAX_BLOCK_SIZE = 4096  # tokens (what lig kv-events accepts; NATS input is checked again)
_CLEARED = AllBlocksCleared()
_NO_PODS: frozenset[str] = frozenset()
_MAX_LORA_NAMES = 4096  # adapters remembered from events (a bound on what events can grow)
# KV-cache group kinds that hold every block of a cached prefix (vLLM's KVCacheSpecKind): their
# block size is the one prompts are cut by.
_PREFIX_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


class PreciseStats:
    """What :meth:`PreciseIndex.apply` did, counted (read by the picker's metrics collector)."""

    __slots__ = ("cleared", "evicted", "gaps", "messages", "reannounced", "recovered",
                 "removed", "removed_unknown", "resyncs", "skipped", "stored")

    def __init__(self) -> None:
        self.messages = 0  # KVBlockChanges applied
        self.stored = 0  # blocks filed
        self.reannounced = 0  # blocks announced again as they were (vLLM's full report mode)
        self.removed = 0  # blocks removed by BlockRemoved
        self.removed_unknown = 0  # BlockRemoved hashes the index did not hold (skipped blocks)
        self.cleared = 0  # ranks cleared (AllBlocksCleared, resync markers)
        self.resyncs = 0  # resync markers received
        self.gaps = 0  # messages of lig kv-events lost on the way (gaps in stream_seq)
        self.recovered = 0  # blocks whose parent was found in a cleared rank's former map
        self.evicted = 0  # blocks dropped to keep the bound
        self.skipped: Counter[str] = Counter()  # blocks not filed, by reason


class _Rank:
    """One data-parallel rank's cache: engine hash -> key, and the hashes in store order from
    ``head`` on (it may still list hashes removed since: they are skipped when met)."""

    __slots__ = ("blocks", "head", "order")

    def __init__(self) -> None:
        self.blocks: dict[int, int] = {}
        self.order: list[int] = []
        self.head = 0

    def tidy(self) -> None:
        """Skip removed hashes at the front; compact the order once it is mostly dead."""
        order, blocks, head = self.order, self.blocks, self.head
        end = len(order)
        while head < end and order[head] not in blocks:
            head += 1
        self.head = head
        if end - head > 2 * len(blocks) + 64:
            self.order = [engine_hash for engine_hash in order[head:] if engine_hash in blocks]
            self.head = 0
        elif head > 1024 and head * 2 > end:
            del order[:head]
            self.head = 0


class _Pod:
    """One pod: its ranks (each a cache per KV-cache group), the keys they hold, and the keys
    speculated on it."""

    __slots__ = ("events", "extra", "former", "incomplete", "keys", "name", "ranks",
                 "speculative", "stream_seqs")

    def __init__(self, name: str) -> None:
        self.name = name
        self.events = False  # some KVBlockChanges of this pod arrived
        self.ranks: dict[int, dict[int, _Rank]] = {}
        """Data-parallel rank -> KV-cache group -> that group's cache."""
        self.keys: set[int] = set()
        # Holdings of a key beyond the first (another rank, or another engine hash of the same
        # tokens): the key stays in ``keys`` until the last one goes. Usually empty.
        self.extra: dict[int, int] = {}
        # Speculated keys by generation (newest last): (generation number, keys).
        self.speculative: list[tuple[int, set[int]]] = []
        # Per rank: the engine hash -> key map it held when last cleared (parents only).
        self.former: dict[int, dict[int, int]] = {}
        # Per rank: the next stream_seq expected from lig kv-events.
        self.stream_seqs: dict[int, int] = {}
        # Per rank: until when its state counts as incomplete (the clock's time).
        self.incomplete: dict[int, float] = {}

    def hold(self, keys: list[int]) -> None:
        """One more holding of each of ``keys``."""
        held = self.keys
        if not self.extra and held.isdisjoint(keys):
            held.update(keys)
            return
        extra = self.extra
        for key in keys:
            if key in held:
                extra[key] = extra.get(key, 0) + 1
            else:
                held.add(key)

    def release(self, keys: list[int]) -> None:
        """One holding of each of ``keys`` went."""
        extra = self.extra
        if not extra:
            self.keys.difference_update(keys)
            return
        held = self.keys
        for key in keys:
            count = extra.get(key)
            if count is None:
                held.discard(key)
            elif count > 1:
                extra[key] = count - 1
            else:
                del extra[key]


class PreciseIndex:
    """Token-block keys -> pods, from the pods' KV-cache events; one per pool.

    ``max_blocks``: the hard bound on blocks kept (0 keeps none). ``speculative_ttl``: seconds a
    speculated block counts at least (at most 1.5 times that; 0: no speculation).
    ``max_speculative``: the bound on speculative entries (default ``max_blocks // 4``).
    ``recovery_s``: seconds a rank stays incomplete after a gap or a resync.
    ``clock``: the time :meth:`match` judges expiry on when not given one (the benchmark's
    virtual clock).
    """

    def __init__(self, max_blocks: int, speculative_ttl: float = DEFAULT_SPECULATIVE_TTL, *,
                 max_speculative: int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 recovery_s: float = DEFAULT_RECOVERY_S) -> None:
        if max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0, not {max_blocks}")
        if speculative_ttl < 0:
            raise ValueError(f"speculative_ttl must be >= 0, not {speculative_ttl}")
        if recovery_s < 0:
            raise ValueError(f"recovery_s must be >= 0, not {recovery_s}")
        self.recovery_s = recovery_s
        self.max_blocks = max_blocks
        self.speculative_ttl = speculative_ttl
        self.max_speculative = max_blocks // 4 if max_speculative is None else max_speculative
        # Speculation is kept in generations of half the ttl; a generation counts while it is
        # one of the newest three, so a key counts from ttl to 1.5 x ttl after it was speculated
        # (dropping a generation is one step, not one per key).
        self._generation = speculative_ttl / 2
        self._clock = clock
        self._pods: dict[str, _Pod] = {}
        self._publishing: set[str] = set()  # pods some changes arrived from
        self._live = 0  # (rank, engine hash) entries held
        self._former = 0  # entries of the former maps (parents only)
        self._incomplete: dict[str, _Pod] = {}  # pods with an incomplete rank (maybe expired)
        self._speculated = 0  # speculative entries held
        self._roots: dict[str | None, int] = {None: root_key(None)}
        self.block_size: int | None = None
        """The block size of the newest ``BlockStored`` applied (a pool runs one)."""
        self.lora_names: set[str] = set()
        """Adapters some ``BlockStored`` was filed under (at most 4,096 remembered)."""
        self.stats = PreciseStats()

    def __len__(self) -> int:
        """Blocks held (rank, engine hash entries; speculation not counted)."""
        return self._live

    @property
    def speculative_blocks(self) -> int:
        """Speculative entries held (expired ones included until dropped)."""
        return self._speculated

    def has_events(self, pod: str) -> bool:
        """Whether ``pod`` publishes KV events (some of its changes were applied)."""
        return pod in self._publishing

    def event_pods(self) -> set[str]:
        """The pods that publish KV events (the index's own set: do not change it)."""
        return self._publishing

    # --- events ----------------------------------------------------------------------------

    def apply(self, changes: KVBlockChanges) -> None:
        """Apply one message of ``lig kv-events``: the events of one batch of one pod's rank."""
        pod = self._pods.get(changes.pod)
        if pod is None:
            pod = self._pods[changes.pod] = _Pod(changes.pod)
        if not pod.events:
            pod.events = True
            self._publishing.add(changes.pod)
        groups = pod.ranks.get(changes.dp_rank)
        if groups is None:
            groups = pod.ranks[changes.dp_rank] = {}
        stats = self.stats
        stats.messages += 1
        dp_rank = changes.dp_rank
        stream_seq = changes.stream_seq
        if stream_seq >= 0:
            expected = pod.stream_seqs.get(dp_rank)
            # 0 starts (or starts over) a stream: a bridge without a recording to continue
            # from replays the pod from its start, or sends a resync marker.
            if stream_seq not in (0, expected):
                # A message lost on the way, or a history that starts after the stream did.
                stats.gaps += 1
                self._mark_incomplete(pod, dp_rank)
            pod.stream_seqs[dp_rank] = stream_seq + 1
        if changes.resync:
            stats.resyncs += 1
            self._mark_incomplete(pod, dp_rank)
        elif changes.source_seq < 0 and changes.ops[:1] == [_CLEARED]:
            # The bridge's restart marker: the engine's cache is empty, and now fully known.
            pod.incomplete.pop(dp_rank, None)
        for op in changes.ops:
            kind = type(op)
            if kind is BlockStored:
                group = op.group_idx  # type: ignore[union-attr]
                cache = groups.get(group)
                if cache is None:
                    cache = groups[group] = _Rank()
                self._store(pod, dp_rank, cache, groups, op)  # type: ignore[arg-type]
            elif kind is BlockRemoved:
                self._remove(pod, groups.get(op.group_idx), op)  # type: ignore[union-attr, arg-type]
            else:  # AllBlocksCleared
                groups = self._clear(pod, dp_rank)
        if self._live > self.max_blocks:
            self._evict()

    def _store(self, pod: _Pod, dp_rank: int, rank: _Rank, groups: dict[int, _Rank],
               op: BlockStored) -> None:
        hashes = op.block_hashes
        skipped = self.stats.skipped
        if op.medium not in _GPU:
            skipped["medium"] += len(hashes)
            return
        if not 0 < op.block_size <= _MAX_BLOCK_SIZE:
            skipped["block_size"] += len(hashes)
            return
        blocks = rank.blocks
        parent = op.parent_block_hash
        if parent is None:
            seed = self._root(op.lora_name)
        else:
            masked_parent = parent & _HASH_MASK
            found = blocks.get(masked_parent)
            if found is None:  # another group of the rank may still hold it (sliding window)
                found = next((other.blocks[masked_parent] for other in groups.values()
                              if masked_parent in other.blocks), None)
            if found is None:
                # The engine holds the parent (a block was just stored on it) and the index
                # does not: evidence that the rank's state is incomplete, renewed for as long
                # as traffic keeps meeting what the index misses.
                self._mark_incomplete(pod, dp_rank)
                former = pod.former.get(dp_rank)
                if former:  # held before a clear: the hash still names it
                    found = former.get(masked_parent)
                if found is None:
                    skipped["parent"] += len(hashes)
                    return
                self.stats.recovered += len(hashes)
            seed = found
        if not op.token_ids:
            skipped["no_tokens"] += len(hashes)
            return
        try:
            keys = block_keys(op.token_ids, op.block_size, seed, len(hashes))
        except OverflowError:  # a token id beyond 32 bits: no tokenizer gives those
            skipped["token_ids"] += len(hashes)
            return
        if len(keys) < len(hashes):  # fewer token ids than full blocks: the rest is unknown
            skipped["token_ids"] += len(hashes) - len(keys)
        if op.kind in _PREFIX_KINDS or (op.kind is None and op.group_idx == 0):
            self.block_size = op.block_size
        masked = [engine_hash & _HASH_MASK for engine_hash in hashes[:len(keys)]]
        if blocks.keys().isdisjoint(masked):  # the usual case: all new
            blocks.update(zip(masked, keys, strict=True))
            rank.order += masked
            pod.hold(keys)
            self._live += len(keys)
            self.stats.stored += len(keys)
        else:
            for engine_hash, key in zip(masked, keys, strict=True):
                old = blocks.get(engine_hash)
                if old == key:  # announced again: a prefix-cache hit in full report mode
                    self.stats.reannounced += 1
                    continue
                if old is not None:
                    pod.release([old])
                    self._live -= 1
                blocks[engine_hash] = key
                rank.order.append(engine_hash)
                pod.hold([key])
                self._live += 1
                self.stats.stored += 1
        rank.tidy()

    def _root(self, lora_name: str | None) -> int:
        root = self._roots.get(lora_name)
        if root is None:
            root = root_key(lora_name)
            if len(self._roots) <= _MAX_LORA_NAMES:
                self._roots[lora_name] = root
            if lora_name and len(self.lora_names) < _MAX_LORA_NAMES:
                self.lora_names.add(lora_name)
        return root

    def _remove(self, pod: _Pod, rank: _Rank | None, op: BlockRemoved) -> None:
        if op.medium not in _GPU:
            return
        if rank is None:  # a group that stored nothing here
            self.stats.removed_unknown += len(op.block_hashes)
            return
        pop = rank.blocks.pop
        keys = [key for engine_hash in op.block_hashes
                if (key := pop(engine_hash & _HASH_MASK, None)) is not None]
        pod.release(keys)
        self._live -= len(keys)
        self.stats.removed += len(keys)
        self.stats.removed_unknown += len(op.block_hashes) - len(keys)

    def _clear(self, pod: _Pod, dp_rank: int) -> dict[int, _Rank]:
        """Empty one rank of ``pod``, every group of it; returns its new (empty) groups. What
        it held stays known as its ``former`` map, for parents only."""
        former: dict[int, int] = {}
        for old in pod.ranks.get(dp_rank, {}).values():
            pod.release(list(old.blocks.values()))
            self._live -= len(old.blocks)
            former.update(old.blocks)
        if former:
            self._former += len(former) - len(pod.former.get(dp_rank, ()))
            pod.former[dp_rank] = former
            self._bound_former(pod, dp_rank)
        self.stats.cleared += 1
        groups: dict[int, _Rank] = {}
        pod.ranks[dp_rank] = groups
        return groups

    def _bound_former(self, pod: _Pod, dp_rank: int) -> None:
        """Keep the former maps within ``max_blocks`` entries: the other ranks' go first, the
        largest first; then the oldest hashes of this one."""
        if self._former <= self.max_blocks:
            return
        others = sorted(((len(entry.former[rank]), entry, rank) for entry in self._pods.values()
                         for rank in entry.former if (entry, rank) != (pod, dp_rank)),
                        key=lambda item: item[0], reverse=True)
        for size, entry, rank in others:
            del entry.former[rank]
            self._former -= size
            if self._former <= self.max_blocks:
                return
        own = pod.former[dp_rank]
        excess = len(own) - self.max_blocks
        pod.former[dp_rank] = dict(islice(own.items(), excess, None))
        self._former -= excess

    def _mark_incomplete(self, pod: _Pod, dp_rank: int) -> None:
        pod.incomplete[dp_rank] = self._clock() + self.recovery_s
        self._incomplete[pod.name] = pod

    def incomplete_pods(self, now: float | None = None) -> Collection[str]:
        """The pods with a rank whose state is incomplete at ``now`` (the clock's time by
        default): score them from the approximate index as well. A live view, not a copy:
        the router asks on every request."""
        if not self._incomplete:
            return _NO_PODS
        now = self._clock() if now is None else now
        gone = []
        for name, pod in self._incomplete.items():
            for rank, until in list(pod.incomplete.items()):
                if until <= now:
                    del pod.incomplete[rank]
            if not pod.incomplete:
                gone.append(name)
        for name in gone:
            del self._incomplete[name]
        return self._incomplete.keys()

    def _evict(self) -> None:
        """Drop blocks until the bound holds: the oldest stored of the rank holding the most."""
        ranks = [(pod, rank) for pod in self._pods.values() for groups in pod.ranks.values()
                 for rank in groups.values()]
        while self._live > self.max_blocks:
            pod, rank = max(ranks, key=lambda entry: len(entry[1].blocks))
            excess = self._live - self.max_blocks
            order, head = rank.order, rank.head
            pop = rank.blocks.pop
            keys: list[int] = []
            while len(keys) < excess and head < len(order):
                # Removed hashes among them give None: take more until enough went.
                victims = order[head:head + excess - len(keys)]
                head += len(victims)
                keys += [key for engine_hash in victims
                         if (key := pop(engine_hash, None)) is not None]
            rank.head = head
            if not keys:  # cannot happen: every live hash is in its rank's order
                raise AssertionError("precise index: the largest rank has no block to evict")
            pod.release(keys)
            rank.tidy()
            self._live -= len(keys)
            self.stats.evicted += len(keys)

    # --- lookups ---------------------------------------------------------------------------

    def match(self, keys: Sequence[int], now: float | None = None) -> Mapping[str, int]:
        """Per pod, how many leading blocks of ``keys`` it holds (really, or speculatively and
        not expired at ``now``, the clock's time by default); pods with none absent."""
        if not keys or not self._pods:
            return {}
        first = keys[0]
        hits: dict[str, int] = {}
        oldest: int | None = None  # the oldest speculative generation still counting
        for pod in self._pods.values():
            held = pod.keys
            if pod.speculative:
                if oldest is None:
                    oldest = self._oldest_generation(self._clock() if now is None else now)
                sets = [held, *(speculated for generation, speculated in pod.speculative
                                if generation >= oldest)]
                depth = _leading_run(sets, keys)
                if depth:
                    hits[pod.name] = depth
            elif first in held:
                hits[pod.name] = len(list(takewhile(held.__contains__, keys)))
        return hits

    # --- speculation -----------------------------------------------------------------------

    def _oldest_generation(self, now: float) -> int:
        return int(now // self._generation) - 2 if self._generation > 0 else 0

    def speculate(self, pod: str, keys: Sequence[int], now: float) -> None:
        """``pod`` was just sent a prompt with these keys: count them as cached there for
        ``speculative_ttl`` (to 1.5 x that) from ``now``, whatever its events say meanwhile."""
        if self.speculative_ttl <= 0 or self.max_speculative <= 0:
            return
        entry = self._pods.get(pod)
        if entry is None:
            entry = self._pods[pod] = _Pod(pod)
        oldest = self._oldest_generation(now)
        generations = entry.speculative
        while generations and generations[0][0] < oldest:
            self._speculated -= len(generations.pop(0)[1])
        if not keys:
            return
        current = oldest + 2
        if not generations or generations[-1][0] != current:
            generations.append((current, set()))
        newest = generations[-1][1]
        before = len(newest)
        newest.update(keys[:self.max_speculative])
        self._speculated += len(newest) - before
        while self._speculated > self.max_speculative:
            self._drop_oldest_speculation()

    def _drop_oldest_speculation(self) -> None:
        """Over the bound: drop the oldest generation any pod has."""
        pod = min((entry for entry in self._pods.values() if entry.speculative),
                  key=lambda entry: entry.speculative[0][0])
        self._speculated -= len(pod.speculative.pop(0)[1])

    # --- membership ------------------------------------------------------------------------

    def pods(self) -> list[str]:
        """The pods the index knows something of (events or speculation)."""
        return list(self._pods)

    def forget(self, pod: str) -> None:
        """``pod`` left the pool: drop everything known of it."""
        entry = self._pods.pop(pod, None)
        if entry is None:
            return
        self._publishing.discard(pod)
        self._incomplete.pop(pod, None)
        self._former -= sum(map(len, entry.former.values()))
        self._live -= sum(len(rank.blocks) for groups in entry.ranks.values()
                          for rank in groups.values())
        self._speculated -= sum(len(keys) for _, keys in entry.speculative)


def _leading_run(sets: list[set[int]], keys: Sequence[int]) -> int:
    """How many leading ``keys`` are each in one of ``sets`` (runs scanned in C, set by set)."""
    depth = 0
    total = len(keys)
    stalled = 0  # sets tried in a row without progress
    index = 0
    while depth < total and stalled < len(sets):
        found = len(list(takewhile(sets[index].__contains__, islice(keys, depth, None))))
        depth += found
        stalled = 0 if found else stalled + 1
        index = (index + 1) % len(sets)
    return depth
