"""Which full blocks of which requests the prefix cache holds, and when they are put there.

Every full block of a request is *registered* (``Request._num_registered``) and, unless it is
private (below), *offered* to the prefix cache (``KVCache.cache``) at once. ``offer`` is the one
place where blocks enter the cache's hash map; they leave it when ``KVCache.allocate`` hands
them out again. The blocks a steady request fills with generated tokens unique to it are
registered late, when it stops being steady (``SteadyRequests.unsteady``): nobody can share them.

Private text (the fast path). Hashing every full block and filing it in the prefix cache
costs as much as the rest of the engine, yet most blocks can never be found there by anyone:
those holding generated tokens unique to their request, and those after a prompt segment whose
seed no other request has used (``seed_owner``). Such blocks stay out of the cache
(``Request._private_from``), and go in when that could make a difference, so that every lookup
finds what it would have found had they been filed at once:

- when a later request uses the seed (``share_text``): the owner's blocks, or, if it has ended,
  those of its freed blocks that nobody reallocated since (``KVCache.still_free``);
- when the request is preempted (``publish``): it looks its own blocks up when it comes back.
  When it recomputes them, it files them at once again: their earlier copies may still be cached,
  and the first copy stays the cached one.
"""

from __future__ import annotations

from collections import deque

from shared.kv_events import BlockStored
from simulator.block_hashes import hash_blocks, token_ids
from simulator.kv_cache import KVCache
from simulator.request import NEVER, Request, Status


class PrefixSharing:
    """One engine's bookkeeping of what its requests' full blocks hold and who can share it."""

    def __init__(self, kv: KVCache, adapters: tuple[str, ...]) -> None:
        self.kv = kv
        self.block_size = kv.block_size
        self.adapter_keys = {name: index + 1 for index, name in enumerate(adapters)}
        """A number for each adapter in block hashes (0: the base model)."""
        self.seed_owner: dict[int, Request] = {}
        """Prompt segment seeds that one request only has used: its private text."""
        self.shared_seeds: set[int] = set()
        self.parked: deque[tuple[int, Request]] = deque()
        """Ended requests whose freed blocks may still hold private text, oldest first, with
        the free queue position after which none of those blocks does."""

    # ---- the engine's events -----------------------------------------------------------------

    def lookup(self, request: Request) -> list[int]:
        """The cached blocks a request being admitted starts with (the longest cached prefix of
        its full blocks, leaving at least its last token to compute)."""
        request._private_from = self.first_private_block(request)
        if not self.kv.enable_prefix_caching:
            return []
        limit = (request._num_tokens - 1) // self.block_size
        if not request.preemptions:
            # Nothing of its private text is cached yet: the lookup would miss there.
            limit = min(limit, request._private_from)
        hash_blocks(request, limit, self.block_size, self.adapter_keys)
        return self.kv.cached_prefix(request.block_hashes[:limit])

    def register_full_blocks(self, request: Request, full: int) -> None:
        """Note that the request's first ``full`` blocks are full, and offer the ones that are
        not private to the prefix cache."""
        end = min(full, request._private_from)
        if request._num_offered < end and self.kv.enable_prefix_caching:
            self.offer(request, end, request.blocks)
        request._num_registered = full
        request._next_full = (full + 1) * self.block_size

    def offer(self, request: Request, end: int, blocks: list[int], parked: bool = False) -> None:
        """Put the request's blocks from ``_num_offered`` to ``end`` in the prefix cache; if
        ``parked`` (``blocks`` were freed), only those still free since."""
        hash_blocks(request, end, self.block_size, self.adapter_keys)
        hashes = request.block_hashes
        kv = self.kv
        last = request._parked_position + len(blocks) - 1  # the free queue position of blocks[0]
        if kv.events is not None:
            self._offer_recording(request, end, blocks, parked, last)
            return
        for index in range(request._num_offered, end):
            if not parked or kv.still_free(last - index):
                kv.cache(blocks[index], hashes[index])
        request._num_offered = end

    def _offer_recording(self, request: Request, end: int, blocks: list[int], parked: bool,
                         last: int) -> None:
        """``offer``, recording a ``BlockStored`` per run of blocks that entered the cache (as
        vLLM does, with the hash of the block before the run as parent)."""
        hashes = request.block_hashes
        kv = self.kv
        events = kv.events
        assert events is not None
        run: list[int] = []  # indexes of the current run of newly cached blocks
        for index in range(request._num_offered, end + 1):
            stored = index < end and (not parked or kv.still_free(last - index)) \
                and kv.cache(blocks[index], hashes[index])
            if stored:
                run.append(index)
            elif run:
                first = run[0]
                events.append(BlockStored(
                    tuple(hashes[first : first + len(run)]),
                    hashes[first - 1] if first else None,
                    token_ids(request, first * self.block_size, index * self.block_size),
                    self.block_size, request.adapter, "GPU", 0, "full_attention"))
                run = []
        request._num_offered = end

    def preempted(self, request: Request) -> None:
        """The request is being preempted: offer its blocks (it will look them up again)."""
        self.publish(request, request._num_registered)
        request._num_published = max(request._num_published, request._num_registered)

    def park(self, request: Request) -> None:
        """The request ended and is about to free its blocks: keep track of the private text
        in them, which a later request may still look up."""
        kv = self.kv
        if kv.enable_prefix_caching and request._num_offered < self.reachable(request):
            # A later request with one of its seeds could look them up: see share_text.
            request._parked_blocks = request.blocks
            request._parked_position = kv.queued
            # Of the blocks it keeps private, the first is freed last (see KVCache.release).
            last = kv.queued + len(request.blocks) - 1 - request._num_offered
            self.parked.append((last, request))
        else:
            self.disown(request)

    def forget_reallocated(self) -> None:
        """Stop tracking freed private text once every block that held it was reallocated."""
        parked = self.parked
        dequeued = self.kv.dequeued
        while parked and parked[0][0] < dequeued:
            request = parked.popleft()[1]
            if request._parked_blocks is not None:  # not published in the meantime
                request._parked_blocks = None
                self.disown(request)

    # ---- private text ------------------------------------------------------------------------

    def claim_seeds(self, request: Request) -> None:
        """Note the prompt segments whose seed no other request has used: its private text. A
        seed used again makes the text of its first user public."""
        if not self.kv.enable_prefix_caching:
            return
        owners = self.seed_owner
        for seed in request._segment_seeds:
            if seed in self.shared_seeds:
                continue
            owner = owners.get(seed)
            if owner is None:
                owners[seed] = request
            elif owner is not request:
                self.share_text(owner)

    def first_private_block(self, request: Request) -> int:
        """The first block of ``request`` that no other request can have the same content in:
        the first touching its private text or (with no ``output`` ids) its generated tokens.
        Blocks it published when preempted come before it: when recomputed, their copies may
        still be cached, and the first copy stays the cached one (``KVCache.cache``)."""
        block_size = self.block_size
        first = request.num_prompt_tokens // block_size if request.spec.output is None else NEVER
        start = 0
        for seed, end in zip(request._segment_seeds, request._segment_ends, strict=True):
            if self.seed_owner.get(seed) is request:
                first = min(first, start // block_size)
                break
            start = end
        return max(first, request._num_published)

    def reachable(self, request: Request) -> int:
        """How many of the request's first blocks another request could have the same content
        in (once its text is public): all full ones, except those holding generated tokens
        unique to it."""
        if request.spec.output is None:
            return min(request._num_registered, request.num_prompt_tokens // self.block_size)
        return request._num_registered

    def share_text(self, owner: Request) -> None:
        """Another request uses a seed of ``owner``'s private text: offer the blocks ``owner``
        kept out of the prefix cache (that request may look them up) and make its text
        public."""
        self.publish(owner, self.reachable(owner))
        if owner.status is Status.RUNNING:
            owner._private_from = self.first_private_block(owner)

    def publish(self, request: Request, end: int) -> None:
        """Make the request's text public, and offer its blocks up to ``end`` to the prefix
        cache: those it holds, or the freed ones that still hold its content."""
        for seed in request._segment_seeds:
            if self.seed_owner.get(seed) is request:
                del self.seed_owner[seed]
                self.shared_seeds.add(seed)
        if request._num_offered < end and self.kv.enable_prefix_caching:
            if request._parked_blocks is None:
                self.offer(request, end, request.blocks)
            else:
                self.offer(request, end, request._parked_blocks, parked=True)
        request._parked_blocks = None

    def disown(self, request: Request) -> None:
        """Forget that ``request`` owns seeds: none of its private text is in the cache."""
        for seed in request._segment_seeds:
            if self.seed_owner.get(seed) is request:
                del self.seed_owner[seed]
