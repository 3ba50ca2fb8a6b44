"""The cost of serving several pools: one routing decision through the gateway (model -> pool,
then that pool's router) against the pool's router called directly (a one-pool picker before
several pools), in the same process and run.

Each pool has ``--pods`` fresh pods and ``--models`` registered names; the gateway serves
``--pools`` pools. Every timed batch routes ``--batch`` request bodies spread over the models of
the first pool (so both paths do the same scheduling work); medians over ``--rounds`` batches, in
microseconds per decision, and their ratio.

Run: ``.venv/bin/python bench/bench_gateway_route.py [--pools 4] [--pods 8] [--rounds 15]``
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec

from services.picker.pools import Gateway
from services.picker.routing import Routed, Router
from services.picker.state import PodTable
from shared.registry_view import RegistryView
from shared.schemas import Endpoint, EndpointSet, InferenceModel, InferencePool, PodMetrics


def build(pools: int, pods: int, models: int) -> tuple[Gateway, Router]:
    """A gateway over ``pools`` pools, and the first pool's router (shared with the gateway)."""
    view = RegistryView()
    for p in range(pools):
        name = f"pool-{p}"
        view.pools[name] = InferencePool(name=name, target_port=8000)
        view.models[name] = {f"m{p}-{i}": InferenceModel(model_name=f"m{p}-{i}", pool=name)
                             for i in range(models)}
        view.endpoints[name] = EndpointSet(pool=name, endpoints=tuple(
            Endpoint(f"{name}-pod-{i}", f"10.{p}.0.{i + 1}", 8000) for i in range(pods)))
    gateway = Gateway([], lambda pool: Router(pool, PodTable(stale_after=3600.0),
                                              random.Random(1)))
    gateway.update(view)
    rng = random.Random(2)
    for name, router in gateway.routers.items():
        for i, endpoint in enumerate(view.endpoints[name].endpoints):
            router.pods.apply(PodMetrics(
                pool=name, pod=endpoint.name, address=endpoint.hostport, seq=i + 1,
                scrape_time_ns=1, scrape_duration_s=0.0, ok=True, waiting=rng.randrange(8),
                running=rng.randrange(8), kv_cache_usage=rng.random() * 0.6))
    return gateway, gateway.routers["pool-0"]


def per_decision(route: Callable[[bytes], object], bodies: list[bytes]) -> float:
    """Microseconds per decision over one batch of ``bodies``."""
    start = time.perf_counter()
    for body in bodies:
        route(body)
    return (time.perf_counter() - start) / len(bodies) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pools", type=int, default=4)
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--models", type=int, default=100)
    parser.add_argument("--batch", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    gateway, router = build(args.pools, args.pods, args.models)
    bodies = [msgspec.json.encode({"model": f"m0-{i % args.models}", "prompt": "hello"})
              for i in range(args.batch)]
    assert all(isinstance(gateway.route(b), Routed) for b in bodies[:10])
    direct, through = [], []
    for _ in range(args.rounds):  # interleaved, so that machine noise hits both alike
        direct.append(per_decision(router.route, bodies))
        through.append(per_decision(gateway.route, bodies))
    d, g = statistics.median(direct), statistics.median(through)
    print(f"{args.pools} pools x {args.pods} pods, {args.models} models each; "
          f"median of {args.rounds} batches of {args.batch}")
    print(f"  pool router directly (one-pool picker): {d:7.2f} us/decision")
    print(f"  gateway (model -> pool -> router):      {g:7.2f} us/decision")
    print(f"  ratio: {g / d:.3f}")


if __name__ == "__main__":
    main()
