"""An approximate index of which pods hold which prompt prefixes, learned from routing.

Nothing asks the model servers what they cache: every routed request is taken to leave its
prompt's blocks in the chosen pod's cache (``record``), by this picker and, through the decision
stream, its peers. ``match`` then tells, per pod, how many *leading* blocks of a new prompt that
pod is believed to hold. It is approximate both ways: a pod evicts blocks the index still lists,
and an entry the index dropped may still be cached; routing only needs a good guess.

Bounded memory: an entry is one block hash with the pods that got it; at most ``max_entries``
entries are kept, least recently recorded first out (an LRU over blocks, so a popular prefix
stays while one-off prompts age out). ``bench/bench_prefix.py`` reports the bytes per entry.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    """Block hash -> pods believed to hold it, LRU-bounded by ``max_entries`` hashes."""

    __slots__ = ("_entries", "max_entries")

    def __init__(self, max_entries: int) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, not {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[int, tuple[str, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, pod: str, hashes: Sequence[int]) -> None:
        """``pod`` was sent a prompt with these chained block hashes."""
        if not hashes or self.max_entries == 0:
            return
        entries = self._entries
        get = entries.get
        touch = entries.move_to_end
        for block in hashes:
            pods = get(block)
            if pods is None:
                entries[block] = (pod,)
            else:
                if pod not in pods:
                    entries[block] = (*pods, pod)
                touch(block)
        excess = len(entries) - self.max_entries
        for _ in range(max(0, excess)):
            entries.popitem(last=False)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per pod, how many leading blocks of ``hashes`` it is believed to hold (pods with
        none absent). A pod counts block *i* only if it also holds every block before it."""
        if not hashes:
            return {}
        get = self._entries.get
        alive = get(hashes[0])  # the pods holding every block so far
        if alive is None:
            return {}
        hits: dict[str, int] = {}
        depth = 1
        for block in hashes[1:]:
            pods = get(block)
            if pods is None:
                break
            # Usually the same pods hold the whole prefix: one tuple comparison per block.
            if pods != alive:
                kept = tuple([pod for pod in alive if pod in pods])
                if len(kept) < len(alive):
                    for pod in alive:
                        if pod not in pods:
                            hits[pod] = depth
                    if not kept:
                        return hits
                    alive = kept
            depth += 1
        for pod in alive:
            hits[pod] = depth
        return hits

    def forget(self, pod: str) -> None:
        """``pod`` left the pool: drop it from every entry (entries left empty go). Costs one
        pass over the index; pods leave rarely."""
        entries = self._entries
        for block, pods in list(entries.items()):
            if pod in pods:
                rest = tuple(name for name in pods if name != pod)
                if rest:
                    entries[block] = rest
                else:
                    del entries[block]

    def pods(self) -> set[str]:
        """Every pod some entry lists (for tests and debugging)."""
        return {pod for pods in self._entries.values() for pod in pods}
