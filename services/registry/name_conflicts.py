"""Model names registered in more than one pool.

The registry accepts them (a picker that serves one pool never sees the others), but a picker
serving several pools routes by model name alone: it keeps such a name with the pool it had (or
routes it nowhere) and reports the conflict. The registry says so up front, in ``--check`` and
when it loads the inputs.
"""

from __future__ import annotations

from services.registry.loader import Registry


def model_name_conflicts(registry: Registry) -> list[str]:
    """One line per model name registered in several pools, naming the pools (sorted)."""
    pools: dict[str, set[str]] = {}
    for model in registry.models:
        pools.setdefault(model.model_name, set()).add(model.pool)
    return [f"modelName {name!r} is registered in pools {', '.join(sorted(owners))}: a picker "
            "serving several of them routes it to one pool only (see docs/multi-pool.md)"
            for name, owners in sorted(pools.items()) if len(owners) > 1]
