"""A simulated pod's KV-cache events, as the pickers' precise prefix index receives them.

``lig sim --kv-events-config`` publishes what the engine's prefix cache records
(``KVCache.events``: ``BlockStored`` with the blocks' token ids, ``BlockRemoved`` when a cached
block is reallocated) once per engine step, in vLLM's wire format; ``lig kv-events`` decodes each
batch and republishes it on NATS as one ``KVBlockChanges``; the picker applies it to the pool's
``PreciseIndex``. The benchmark keeps every step of that path except the sockets: after each
engine step, :class:`KVEventFeed` takes the step's events, encodes them as vLLM's payload (the
simulator's own encoder), decodes them with the collector's decoder (hashes normalised to
uint64, as from a real pod) and wraps them in a ``KVBlockChanges``; the fleet delivers it to
every picker replica ``kv_event_delay`` seconds of virtual time later (``scheduling_bench/
fleet.py``).

A completion prompt of token ids needs no tokenizer: :class:`TokenIdPrompts` is the pool's
``PromptTokenizer`` in the benchmark (its workloads with ``token_ids`` send ids, which the
engines compute on too).
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.kv_blocks import KVBlockChanges
from shared.kv_events import Encoding, KVEventDecoder, encode_payload
from simulator.kv_cache import KVCache


class KVEventFeed:
    """One pod's event stream: a batch per engine step that changed its prefix cache."""

    def __init__(self, pool: str, pod: str, address: str, encoding: Encoding = "map") -> None:
        self.pool = pool
        self.pod = pod
        self.address = address
        self.encoding = encoding
        self.seq = -1
        """Sequence number of the last batch taken (the first is 0, as vLLM's)."""
        self._decoder = KVEventDecoder()

    @staticmethod
    def attach(kv: KVCache) -> None:
        """Make the engine's prefix cache record its events (``lig sim --kv-events-config``)."""
        kv.events = []

    def take(self, kv: KVCache, now: float) -> KVBlockChanges | None:
        """The events ``kv`` recorded since the last call, as one ``KVBlockChanges`` sent at
        ``now``; None when there were none. RuntimeError if they do not decode: the simulator's
        own events, so a bug, never a result."""
        events = kv.events
        if not events:
            return None
        kv.events = []
        self.seq += 1
        batch = self._decoder.decode_payload(self.seq,
                                             encode_payload(now, events, self.encoding, 0))
        if batch is None or len(batch.events) != len(events):
            raise RuntimeError(f"{self.pod}: the simulator's KV events did not decode "
                               f"(skipped: {dict(self._decoder.skipped)})")
        return KVBlockChanges(self.pool, self.pod, self.address, batch.seq, batch.ts,
                              list(batch.events), batch.dp_rank or 0)


class TokenIdPrompts:
    """The ``PromptTokenizer`` of a pool whose clients send completion prompts as token ids:
    those ids (the first prompt of a batch); None for text and chat (no tokenizer here)."""

    def prompt_token_ids(self, prompt: object, messages: object) -> Sequence[int] | None:
        """The ids of a completion ``prompt`` of token ids, else None."""
        if messages is not None or not isinstance(prompt, list) or not prompt:
            return None
        first = prompt[0]
        ids = first if isinstance(first, list) else prompt
        return ids if all(type(token) is int for token in ids) else None
