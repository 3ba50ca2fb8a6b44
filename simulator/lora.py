"""Where LoRA adapters live: ``max_loras`` GPU slots and a CPU cache of ``max_cpu_loras``.

Before a step runs, every adapter its batch uses must sit in a GPU slot. An adapter already
there costs nothing; one in the CPU cache costs ``cpu_load_s``; any other is read from disk
(``disk_load_s`` in all) and is then kept in the CPU cache too. Both places evict their least
recently used adapter that the batch does not need. The engine never builds a batch with more than
``max_loras`` adapters, so a slot can always be found.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import msgspec


class AdapterLoad(msgspec.Struct, frozen=True):
    """What activating one batch's adapters cost."""

    seconds: float = 0.0
    from_cpu: int = 0
    from_disk: int = 0


NO_LOAD = AdapterLoad()


class AdapterSlots:
    """LRU residency of adapters on the GPU and in the CPU cache."""

    def __init__(self, max_loras: int, max_cpu_loras: int, cpu_load_s: float, disk_load_s: float):
        if max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.cpu_load_s = cpu_load_s
        self.disk_load_s = disk_load_s
        self._gpu: OrderedDict[str, None] = OrderedDict()
        self._cpu: OrderedDict[str, None] = OrderedDict()

    @property
    def on_gpu(self) -> tuple[str, ...]:
        """Adapters in GPU slots, least recently used first."""
        return tuple(self._gpu)

    @property
    def in_cpu_cache(self) -> tuple[str, ...]:
        """Adapters in the CPU cache, least recently used first."""
        return tuple(self._cpu)

    def activate(self, adapters: Iterable[str]) -> AdapterLoad:
        """Make ``adapters`` (at most ``max_loras``) resident on the GPU; return the cost.

        They are used, and loaded, in name order: the order of a set depends on the hash seed
        of the process, and LRU order decides later evictions."""
        names = sorted(adapters)
        needed = [name for name in names if name not in self._gpu]
        for name in names:
            if name in self._gpu:
                self._gpu.move_to_end(name)
        if not needed:
            return NO_LOAD
        keep = set(names)
        seconds = 0.0
        from_cpu = from_disk = 0
        for name in needed:
            if name in self._cpu:
                self._cpu.move_to_end(name)
                seconds += self.cpu_load_s
                from_cpu += 1
            else:
                seconds += self.disk_load_s
                from_disk += 1
                _insert_lru(self._cpu, name, self.max_cpu_loras, keep)
            _insert_lru(self._gpu, name, self.max_loras, keep)
        return AdapterLoad(seconds=seconds, from_cpu=from_cpu, from_disk=from_disk)


def _insert_lru(cache: OrderedDict[str, None], name: str, capacity: int, keep: set[str]) -> None:
    """Add ``name`` as most recent, first evicting the oldest entries not in ``keep``."""
    if len(cache) >= capacity:
        for old in [old for old in cache if old not in keep][: len(cache) - capacity + 1]:
            del cache[old]
    cache[name] = None
