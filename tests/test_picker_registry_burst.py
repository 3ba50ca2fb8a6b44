"""A registry burst on a real nats-server: 10,000 models reach a picker's router in O(changes)
and the event loop keeps serving meanwhile (issue 13, item 6).

Before, every KV entry rebuilt every model route: 10,000 models cost the picker ~30 s of CPU with
its loop blocked for seconds at a time, longer than Envoy's 2 s ext_proc message timeout, so
requests failed and (the response-rewrite filter failing open) responses named the target model.
"""

from __future__ import annotations

import asyncio
import random
import time

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from prometheus_client import CollectorRegistry

from protocols.http2 import Http2Server
from services.picker.app import _NatsLink
from services.picker.ext_proc import NONE, REWRITE_HEADER, Processor, http2_handlers
from services.picker.observability import PickerMetrics
from services.picker.pools import Gateway
from services.picker.routing import Routed
from services.picker.state import PodTable
from shared.nats_connection import NatsSettings, connect
from shared.registry_view import RegistryView
from shared.schemas import (
    Endpoint,
    EndpointSet,
    InferenceModel,
    InferencePool,
    PodMetrics,
    TargetModel,
    encode,
)
from shared.subjects import Subjects, endpoints_key, model_key, pool_key
from tests.support.registry_burst import LoopStall, TimedRouter, put_models
from tests.support.waiting import eventually

POOL = "pool-a"
MODELS = 10_000
MAX_REQUESTS = 5000  # the client below stops at this many requests, or when the burst is in


class Traffic:
    """Requests for a rewritten model through the picker's ext_proc server while the burst
    applies, as Envoy sends them: the routing stream, then the response-rewrite stream."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.requests = 0
        # The most CPU time the event loop's thread spent while one answer was awaited: the work
        # the answer waited behind (this test's client, the server and the registry watch share
        # the loop). Wall time also counted the other processes of a loaded machine.
        self.slowest = 0.0
        self.wrong: list[str] = []

    async def _answer(self, call: grpc.aio.StreamStreamCall, message: pb.ProcessingRequest
                      ) -> pb.ProcessingResponse:
        start = time.thread_time()
        await call.write(message)
        answer = await call.read()
        self.slowest = max(self.slowest, time.thread_time() - start)
        return answer

    async def run(self, done: asyncio.Event) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = external_processor_pb2_grpc.ExternalProcessorStub(channel)
            while not done.is_set() and self.requests < MAX_REQUESTS:
                self.requests += 1
                routing = stub.Process()
                headers = pb.ProcessingRequest()
                headers.request_headers.headers.headers.add(key=":path", raw_value=b"/v1/x")
                await self._answer(routing, headers)
                answer = await self._answer(routing, pb.ProcessingRequest(
                    request_body=pb.HttpBody(body=b'{"model":"chat"}', end_of_stream=True)))
                await routing.done_writing()
                body = answer.request_body.response.body_mutation.body
                if body != b'{"model":"chat-v2"}':
                    self.wrong.append(f"routed body {body!r}")
                rewrite = stub.Process()
                headers = pb.ProcessingRequest()
                headers.request_headers.headers.headers.add(key=REWRITE_HEADER, raw_value=b"chat")
                headers.request_headers.end_of_stream = True
                headers.protocol_config.request_body_mode = NONE
                await self._answer(rewrite, headers)
                response = pb.ProcessingRequest()
                response.response_headers.headers.headers.add(key="content-type",
                                                              raw_value=b"application/json")
                await self._answer(rewrite, response)
                answer = await self._answer(rewrite, pb.ProcessingRequest(response_body=pb.HttpBody(
                    body=b'{"model":"chat-v2","id":"x"}', end_of_stream=True)))
                await rewrite.done_writing()
                body = answer.response_body.response.body_mutation.body
                if body != b'{"model":"chat","id":"x"}':
                    self.wrong.append(f"response body {body!r}")


async def test_ten_thousand_models_apply_in_one_pass_while_the_loop_keeps_serving(
        nats_server) -> None:  # type: ignore[no-untyped-def]
    subjects = Subjects()
    client = await connect(NatsSettings(url=nats_server.url), "test")
    js = client.jetstream()
    kv = await js.create_key_value(bucket=subjects.registry_bucket, history=1)
    await kv.put(pool_key(POOL), encode(InferencePool(name=POOL, target_port=8000)))
    await kv.put(endpoints_key(POOL), encode(
        EndpointSet(pool=POOL, endpoints=(Endpoint("pod-a", "127.0.0.1", 8000),))))
    pods = PodTable(stale_after=600.0)
    pods.apply(PodMetrics(pool=POOL, pod="pod-a", address="127.0.0.1:8000", seq=1,
                          scrape_time_ns=1, scrape_duration_s=0.0, ok=True))
    await kv.put(model_key(POOL, "chat"), encode(InferenceModel(
        model_name="chat", pool=POOL, target_models=(TargetModel("chat-v2", 1),))))
    router = TimedRouter(POOL, pods, random.Random(1))
    gateway = Gateway.serving(router)
    server = Http2Server(http2_handlers(Processor(gateway, PickerMetrics(CollectorRegistry()),
                                                  "x-gateway-destination-endpoint")), 1 << 20)
    traffic = Traffic(await server.start("127.0.0.1", 0))
    view = RegistryView()
    # The picker's own NATS wiring (registry watch into the router), in this process.
    link = _NatsLink(NatsSettings(url=nats_server.url), subjects, view, gateway,
                     PickerMetrics(CollectorRegistry()))
    stop = asyncio.Event()
    task = asyncio.create_task(link.run(stop))
    last = f'{{"model": "m{MODELS - 1}"}}'.encode()

    def last_model_rewritten() -> bool:
        result = router.route(last)
        return isinstance(result, Routed) and result.target_model == f"m{MODELS - 1}-target"

    try:
        await eventually(lambda: link.synced, within=10, what="registry synced")
        applied = asyncio.Event()
        with LoopStall() as stall:
            clients = asyncio.create_task(traffic.run(applied))
            await put_models(kv, POOL, MODELS)
            await eventually(last_model_rewritten, within=20, what="every model applied")
            applied.set()
            await asyncio.wait_for(clients, 10)
        assert len(view.models[POOL]) == MODELS + 1  # and "chat"
        for index in (0, MODELS // 2, MODELS - 1):  # every model resolves to its target
            result = router.route(f'{{"model": "m{index}"}}'.encode())
            assert isinstance(result, Routed) and result.target_model == f"m{index}-target"
        # O(changes): the whole burst costs about as much as applying 10,000 models once
        # (~0.05 s); rebuilding every route per entry cost tens of seconds.
        print(f"router updates: {router.updates}, {router.busy:.3f} s CPU; longest loop stall "
              f"{stall.worst:.3f} s CPU; {traffic.requests} requests meanwhile, slowest answer "
              f"after {traffic.slowest:.3f} s CPU")
        assert router.busy < 2.0, router.busy
        assert router.updates < MODELS / 4, router.updates  # one per burst, not per entry
        # Envoy gives a picker 2 s per ext_proc message before failing open (a response that
        # then passes unrewritten names the target model): the loop never stalls near that,
        # and every request during the burst was routed and its response rewritten back.
        assert stall.worst < 0.5, stall.worst
        assert traffic.requests > 0 and not traffic.wrong, traffic.wrong[:5]
        assert traffic.slowest < 2.0, traffic.slowest
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await server.stop(0)
        await client.close()
