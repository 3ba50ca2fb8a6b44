"""``lig registry --check PATH...``: validate the inputs and print what would be published.

Needs no NATS, so operators can run it before shipping a change (and CI on every commit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

from services.registry.files import load, read_files
from services.registry.loader import InvalidRegistry, Registry
from services.registry.name_conflicts import model_name_conflicts

EXIT_OK = 0
EXIT_INVALID = 2


def check(paths: Sequence[str], out: TextIO, err: TextIO) -> int:
    """Print a summary of the registry in ``paths`` to ``out``, or its problems to ``err``."""
    snapshot = read_files(paths)
    try:
        registry = load(snapshot)
    except InvalidRegistry as exc:
        for problem in exc.problems:
            print(problem, file=err)
        print(f"invalid: {len(exc.problems)} problem(s); nothing would be published", file=err)
        return EXIT_INVALID
    print(summarize(registry, len(snapshot.files)), file=out)
    for conflict in model_name_conflicts(registry):
        print(f"warning: {conflict}", file=out)
    if not registry.pools:
        print("note: no pools; a running registry refuses to publish this over published pools "
              "unless --allow-empty (docs/registry.md)", file=out)
    return EXIT_OK


def summarize(registry: Registry, file_count: int) -> str:
    """A few human-readable lines per pool: endpoints, policy and each model's traffic split."""
    endpoint_sets = {e.pool: e for e in registry.endpoint_sets}
    lines = [f"valid: {len(registry.pools)} pool(s), {len(registry.models)} model(s) "
             f"from {file_count} file(s)"]
    for pool in registry.pools:
        members = endpoint_sets.get(pool.name)
        listed = (f"{len(members.endpoints)} endpoint(s)" if members is not None
                  else "no endpoints listed (discovered elsewhere)")
        unknown = "rejected" if pool.reject_unknown_models else "passed through"
        lines.append(f"pool {pool.name}: port {pool.target_port}, {listed}, policy "
                     f"{pool.policy.name}, unknown models {unknown}")
        if members is not None:
            lines += [f"  endpoint {e.name} {e.hostport}" for e in members.endpoints]
        for model in registry.models:
            if model.pool != pool.name:
                continue
            total = sum(t.weight for t in model.target_models)
            split = ", ".join(f"{t.name} {100 * t.weight / total:.3g}%"
                              for t in model.target_models)
            lines.append(f"  model {model.model_name} [{model.criticality.value}] -> {split}")
    return "\n".join(lines)
