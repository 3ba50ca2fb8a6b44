"""The ext_proc exchange on the hot path, in-process: one BUFFERED routing exchange (request
headers, then the body, then the stream's end) through :class:`services.picker.ext_proc.Exchange`,
against the same exchange through ``services/picker/ext_proc.py`` of a git revision (``--rev``,
default ``main``), loaded beside it in the same process and run.

Both run on the same pool (``--pods`` fresh pods, the cheap ``least-queue`` policy, so that the
exchange's own work is a large share of the time), with the same prebuilt messages; each round
builds both pools afresh, and rounds are interleaved (each side first in every other round), so
that neither the machine's noise nor the order favours one side. Medians over ``--rounds``
rounds of ``--exchanges`` exchanges, in microseconds of CPU time per exchange (the process's, so
that other processes on a shared machine count less), and their ratio.

Run: ``.venv/bin/python bench/bench_exchange.py [--rev main] [--exchanges 20000] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import timeit
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry

from bench.baseline import module_at
from services.picker import ext_proc
from services.picker.observability import PickerMetrics
from services.picker.pools import Gateway
from services.picker.routing import Router
from services.picker.state import PodTable
from shared.registry_view import RegistryView
from shared.schemas import (
    Endpoint,
    EndpointSet,
    InferenceModel,
    InferencePool,
    PodMetrics,
    PolicyConfig,
)

POOL = "pool-a"
HEADER = "x-gateway-destination-endpoint"


def gateway(pods: int) -> Gateway:
    """One pool of ``pods`` fresh pods serving the model ``chat``."""
    table = PodTable(stale_after=3600.0)
    router = Router(POOL, table, random.Random(1))
    view = RegistryView()
    view.pools[POOL] = InferencePool(name=POOL, target_port=8000,
                                     policy=PolicyConfig("least-queue"))
    view.models[POOL] = {"chat": InferenceModel(model_name="chat", pool=POOL)}
    view.endpoints[POOL] = EndpointSet(pool=POOL, endpoints=tuple(
        Endpoint(f"pod-{i}", f"10.0.0.{i}", 8000) for i in range(pods)))
    router.update(view)
    for i in range(pods):
        table.apply(PodMetrics(pool=POOL, pod=f"pod-{i}", address=f"10.0.0.{i}:8000", seq=1,
                               scrape_time_ns=1, scrape_duration_s=0.0, ok=True, waiting=i))
    return Gateway.serving(router)


def messages() -> tuple[pb.ProcessingRequest, pb.ProcessingRequest]:
    """The request headers (told BUFFERED, as the shipped bootstrap sends them) and body."""
    headers = pb.ProcessingRequest()
    for key, value in ((":method", b"POST"), (":path", b"/v1/completions"),
                       ("content-type", b"application/json")):
        header = headers.request_headers.headers.headers.add()
        header.key, header.raw_value = key, value
    headers.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.BUFFERED
    body = pb.ProcessingRequest()
    body.request_body.body = b'{"model": "chat", "prompt": "hello", "max_tokens": 16}'
    body.request_body.end_of_stream = True
    return headers, body


def per_exchange(module: Any, pods: int, exchanges: int, headers: pb.ProcessingRequest,
                 body: pb.ProcessingRequest) -> float:
    """Microseconds of CPU per exchange (``headers`` and ``body`` answered, then the stream's
    end) through ``module``'s :class:`Exchange`, on a pool built afresh (so that neither side
    keeps the state, or the memory, of the first one built), after a short warm-up."""
    processor = module.Processor(gateway(pods), PickerMetrics(CollectorRegistry()), HEADER)
    exchange_class = module.Exchange

    def one() -> None:
        exchange = exchange_class(processor)
        exchange.handle(headers)
        exchange.handle(body)
        exchange.close()

    one()
    timeit.timeit(one, number=exchanges // 10)
    return timeit.timeit(one, timer=time.process_time, number=exchanges) / exchanges * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default="main", help="git revision of the baseline")
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--exchanges", type=int, default=20_000, help="exchanges per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    headers, body = messages()
    baseline = module_at(args.rev, "services/picker/ext_proc.py", "ext_proc_baseline")
    modules = {"baseline": baseline, "this tree": ext_proc}
    times: dict[str, list[float]] = {name: [] for name in modules}
    for round_ in range(args.rounds):  # interleaved, each first in every other round
        for name in list(modules)[::1 if round_ % 2 else -1]:
            times[name].append(per_exchange(modules[name], args.pods, args.exchanges,
                                            headers, body))
    medians = {name: statistics.median(rounds) for name, rounds in times.items()}
    print(f"BUFFERED routing exchange (headers, body, close), {args.pods} pods, least-queue; "
          f"median of {args.rounds} rounds of {args.exchanges}")
    for name, median in medians.items():
        label = f"{name} ({args.rev})" if name == "baseline" else name
        print(f"  {label:<20} {median:7.2f} us CPU/exchange   rounds: "
              + " ".join(f"{t:.2f}" for t in times[name]))
    print(f"  ratio: {medians['this tree'] / medians['baseline']:.3f}")


if __name__ == "__main__":
    main()
