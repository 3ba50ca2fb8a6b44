"""ext_proc message handling with real protobuf messages, and the servicer on loopback gRPC."""

from __future__ import annotations

import asyncio
import random

import grpc
import msgspec
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from google.protobuf import json_format
from prometheus_client import CollectorRegistry

from protocols.http2 import Http2Server
from services.picker.app import grpc_server
from services.picker.ext_proc import (
    BUFFERED,
    NONE,
    REWRITE_HEADER,
    STREAMED,
    Exchange,
    ExternalProcessor,
    Processor,
    ProcessStream,
    http2_handlers,
)
from services.picker.observability import PickerMetrics
from services.picker.pools import Gateway
from services.picker.routing import Router
from services.picker.state import PodTable
from shared.registry_view import RegistryView
from shared.schemas import (
    Criticality,
    Endpoint,
    EndpointSet,
    InferenceModel,
    InferencePool,
    PodMetrics,
    TargetModel,
)

HEADER = "x-gateway-destination-endpoint"
POOL = "pool-a"


def make_processor(**pool_fields: object) -> Processor:
    pods = PodTable(stale_after=60.0)
    router = Router(POOL, pods, random.Random(3))
    view = RegistryView()
    view.pools[POOL] = InferencePool(name=POOL, target_port=8000, **pool_fields)  # type: ignore[arg-type]
    view.models[POOL] = {
        "chat": InferenceModel(model_name="chat", pool=POOL,
                               target_models=(TargetModel("chat-v2", 1),)),
        "plain": InferenceModel(model_name="plain", pool=POOL),
        "batch": InferenceModel(model_name="batch", pool=POOL,
                                criticality=Criticality.SHEDDABLE),
    }
    view.endpoints[POOL] = EndpointSet(pool=POOL, endpoints=(Endpoint("pod-a", "10.1.2.3", 8000),))
    router.update(view)
    pods.apply(PodMetrics(pool=POOL, pod="pod-a", address="10.1.2.3:8000", seq=1,
                          scrape_time_ns=1, scrape_duration_s=0.0, ok=True, waiting=0))
    return Processor(Gateway.serving(router), PickerMetrics(CollectorRegistry()), HEADER)


def request_headers(end_of_stream: bool = False, mode: int | None = BUFFERED,
                    nowait: bool = False, response_mode: int = NONE) -> pb.ProcessingRequest:
    message = pb.ProcessingRequest()
    headers = message.request_headers
    headers.end_of_stream = end_of_stream
    for key, value in ((":method", b"POST"), (":path", b"/v1/completions"),
                       (HEADER, b"6.6.6.6:1")):
        header = headers.headers.headers.add()
        header.key, header.raw_value = key, value
    if mode is not None:
        message.protocol_config.request_body_mode = mode
        message.protocol_config.response_body_mode = response_mode
        message.protocol_config.send_body_without_waiting_for_header_response = nowait
    return message


def request_body(body: bytes, end_of_stream: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=end_of_stream))


def response_headers(content_type: bytes) -> pb.ProcessingRequest:
    message = pb.ProcessingRequest()
    for key, value in ((":status", b"200"), ("content-type", content_type),
                       ("content-length", b"99")):
        header = message.response_headers.headers.headers.add()
        header.key, header.raw_value = key, value
    return message


def response_body(body: bytes, end_of_stream: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=end_of_stream))


def set_headers(common: pb.CommonResponse | pb.ImmediateResponse) -> dict[str, bytes]:
    mutation = common.headers if isinstance(common, pb.ImmediateResponse) else (
        common.header_mutation)
    return {o.header.key: o.header.raw_value for o in mutation.set_headers}


def test_buffered_request_is_routed_with_header_metadata_and_no_body_change() -> None:
    exchange = Exchange(make_processor())
    (continue_,) = exchange.handle(request_headers())
    common = continue_.request_headers.response
    assert common.clear_route_cache
    # spoofed values go away
    assert list(common.header_mutation.remove_headers) == [HEADER, REWRITE_HEADER]
    (answer,) = exchange.handle(request_body(b'{"model": "plain", "prompt": "x"}'))
    common = answer.request_body.response
    assert set_headers(common) == {HEADER: b"10.1.2.3:8000"}
    assert common.header_mutation.set_headers[0].header.value == ""  # Envoy reads raw_value only
    assert common.clear_route_cache
    assert not common.HasField("body_mutation")
    assert json_format.MessageToDict(answer.dynamic_metadata) == {
        "envoy.lb": {HEADER: "10.1.2.3:8000"}}
    assert exchange.handle(response_headers(b"application/json")) == (
        exchange._p.response_headers_continue,)
    assert exchange._p.gateway.in_flight() == {"pod-a": 1}
    exchange.close()
    assert exchange._p.gateway.in_flight() == {}


def test_resolved_target_rewrites_body_content_length_and_the_response() -> None:
    exchange = Exchange(make_processor())
    exchange.handle(request_headers())
    (answer,) = exchange.handle(request_body(b'{"model": "chat", "max_tokens": 5}'))
    common = answer.request_body.response
    body = common.body_mutation.body
    assert msgspec.json.decode(body) == {"model": "chat-v2", "max_tokens": 5}
    assert set_headers(common)["content-length"] == str(len(body)).encode()
    assert set_headers(common)[REWRITE_HEADER] == b"chat"  # enables Envoy's rewrite filter
    # ... whose streams start with the response headers and learn the name from here.
    assert json_format.MessageToDict(answer.dynamic_metadata)["lig"] == {
        "requested_model": "chat"}

    (headers_answer,) = exchange.handle(response_headers(b"application/json"))
    assert headers_answer.mode_override.response_body_mode == BUFFERED
    assert not headers_answer.response_headers.response.header_mutation.remove_headers
    (body_answer,) = exchange.handle(response_body(
        b'{"model": "chat-v2", "usage": {"prompt_tokens": 4, "completion_tokens": 2}}'))
    new = body_answer.response_body.response.body_mutation.body
    assert msgspec.json.decode(new)["model"] == "chat"
    assert set_headers(body_answer.response_body.response) == {
        "content-length": str(len(new)).encode()}
    exchange.close()
    metrics = exchange._p.metrics.tokens.labels("chat", "completion")._value.get()
    assert metrics == 2


def test_rewrite_filter_stream_puts_the_requested_name_back() -> None:
    exchange = Exchange(make_processor())
    message = request_headers(mode=NONE)
    header = message.request_headers.headers.headers.add()
    header.key, header.raw_value = REWRITE_HEADER, b"llama%2F3%20chat%C3%A9"
    (answer,) = exchange.handle(message)
    assert list(answer.request_headers.response.header_mutation.remove_headers) == [
        REWRITE_HEADER]
    assert exchange.routed is None  # this stream routes nothing
    (headers_answer,) = exchange.handle(response_headers(b"application/json"))
    assert headers_answer.mode_override.response_body_mode == BUFFERED
    (body_answer,) = exchange.handle(response_body(b'{"model": "target"}'))
    assert msgspec.json.decode(body_answer.response_body.response.body_mutation.body) == {
        "model": "llama/3 chat\u00e9"}
    exchange.close()
    assert exchange._p.gateway.in_flight() == {}


@pytest.mark.parametrize("content_type, mode", [(b"application/json", BUFFERED),
                                                (b"text/event-stream", STREAMED)])
def test_rewrite_stream_starting_at_the_response_takes_the_name_from_metadata(
        content_type: bytes, mode: int) -> None:
    exchange = Exchange(make_processor())
    message = response_headers(content_type)
    message.protocol_config.request_body_mode = NONE
    message.protocol_config.response_body_mode = NONE
    message.metadata_context.filter_metadata["lig"].fields[
        "requested_model"].string_value = "llama/3 chat\u00e9"
    (headers_answer,) = exchange.handle(message)
    assert headers_answer.mode_override.response_body_mode == mode
    assert headers_answer.mode_override.request_body_mode == NONE
    (body_answer,) = exchange.handle(response_body(
        b'{"model": "target"}' if mode == BUFFERED else b'data: {"model": "target"}\n\n'))
    assert b'"model":"llama/3 chat\xc3\xa9"' in (
        body_answer.response_body.response.body_mutation.body)
    exchange.close()
    assert exchange._p.gateway.in_flight() == {}


def test_rewrite_stream_without_the_name_passes_the_response_unchanged() -> None:
    exchange = Exchange(make_processor())
    message = response_headers(b"application/json")
    message.protocol_config.response_body_mode = NONE
    assert exchange.handle(message) == (exchange._p.response_headers_continue,)
    exchange.close()


def test_event_stream_response_is_streamed_without_content_length() -> None:
    exchange = Exchange(make_processor())
    exchange.handle(request_headers())
    exchange.handle(request_body(b'{"model": "chat", "stream": true}'))
    (headers_answer,) = exchange.handle(response_headers(b"text/event-stream; charset=utf-8"))
    assert headers_answer.mode_override.response_body_mode == STREAMED
    assert headers_answer.mode_override.request_body_mode == BUFFERED  # both modes restated
    assert list(headers_answer.response_headers.response.header_mutation.remove_headers) == [
        "content-length"]
    (first,) = exchange.handle(response_body(b'data: {"model":"chat-v2","x":1}\n\ndata: {"mo',
                                             end_of_stream=False))
    assert first.response_body.response.body_mutation.body == (
        b'data: {"model":"chat","x":1}\n\n')
    (last,) = exchange.handle(response_body(b'del":"chat-v2"}\n\n', end_of_stream=True))
    assert last.response_body.response.body_mutation.body == b'data: {"model":"chat"}\n\n'
    assert not last.response_body.response.header_mutation.set_headers


@pytest.mark.parametrize("body, status", [
    (b"{nope", 400), (b'{"stream": true}', 400), (b'{"model": "unknown"}', 404)])
def test_errors_are_immediate_json_responses(body: bytes, status: int) -> None:
    exchange = Exchange(make_processor(reject_unknown_models=True))
    exchange.handle(request_headers())
    (answer,) = exchange.handle(request_body(body))
    immediate = answer.immediate_response
    assert immediate.status.code == status
    assert set_headers(immediate) == {"content-type": b"application/json"}
    assert set(msgspec.json.decode(immediate.body)["error"]) == {"message", "type", "code"}
    exchange.close()
    assert exchange._p.gateway.in_flight() == {}


def test_429_carries_retry_after() -> None:
    processor = make_processor()
    pods = processor.gateway.routers[POOL].pods
    pods.apply(PodMetrics(pool=POOL, pod="pod-a", address="10.1.2.3:8000", seq=2,
                          scrape_time_ns=2, scrape_duration_s=0.0, ok=True,
                          waiting=50, kv_cache_usage=0.99))
    exchange = Exchange(processor)
    exchange.handle(request_headers())
    (answer,) = exchange.handle(request_body(b'{"model": "batch"}'))
    assert answer.immediate_response.status.code == 429
    assert set_headers(answer.immediate_response)["retry-after"] == b"1"


def test_bodiless_request_is_routed_on_its_headers() -> None:
    exchange = Exchange(make_processor())
    (answer,) = exchange.handle(request_headers(end_of_stream=True))
    assert set_headers(answer.request_headers.response) == {HEADER: b"10.1.2.3:8000"}
    assert answer.request_headers.response.clear_route_cache
    assert REWRITE_HEADER in answer.request_headers.response.header_mutation.remove_headers


def test_streamed_body_without_waiting_holds_every_answer_until_the_end() -> None:
    exchange = Exchange(make_processor())
    assert exchange.handle(request_headers(mode=STREAMED, nowait=True)) == ()
    assert exchange.handle(request_body(b'{"model": "ch', end_of_stream=False)) == ()
    assert exchange.handle(request_body(b'at", "prompt": "x"', end_of_stream=False)) == ()
    answers = exchange.handle(request_body(b"}", end_of_stream=True))
    assert [a.WhichOneof("response") for a in answers] == [
        "request_headers", "request_body", "request_body", "request_body"]
    headers = set_headers(answers[0].request_headers.response)
    new_body = answers[3].request_body.response.body_mutation.body
    assert headers[HEADER] == b"10.1.2.3:8000"
    assert headers["content-length"] == str(len(new_body)).encode()
    assert msgspec.json.decode(new_body) == {"model": "chat-v2", "prompt": "x"}
    assert all(a.request_body.response.body_mutation.clear_body for a in answers[1:3])


def test_a_streamed_body_without_waiting_stays_in_flight_until_the_stream_ends() -> None:
    """Its held headers answer carries the destination; the request was counted finished as
    soon as it was routed before (taken twice)."""
    exchange = Exchange(make_processor())
    exchange.handle(request_headers(mode=STREAMED, nowait=True))
    exchange.handle(request_body(b'{"model": "plain"}', end_of_stream=True))
    assert exchange._p.gateway.in_flight() == {"pod-a": 1}
    exchange.close()
    assert exchange._p.gateway.in_flight() == {}


def test_streamed_body_with_waiting_is_switched_to_buffered() -> None:
    exchange = Exchange(make_processor())
    (answer,) = exchange.handle(request_headers(mode=STREAMED, response_mode=STREAMED))
    assert answer.mode_override.request_body_mode == BUFFERED
    assert answer.mode_override.response_body_mode == STREAMED
    (routed,) = exchange.handle(request_body(b'{"model": "plain"}'))
    assert set_headers(routed.request_body.response)[HEADER] == b"10.1.2.3:8000"


def test_trailers_are_passed() -> None:
    exchange = Exchange(make_processor())
    (answer,) = exchange.handle(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    assert answer.HasField("request_trailers")


class ExplodingRouter(Router):
    def route_model(self, body: bytes, requested: str):  # type: ignore[override]
        raise RuntimeError("bug")


def test_process_stream_answers_serialized_and_ends_on_garbage() -> None:
    stream = ProcessStream(make_processor())
    answers, done = stream.on_message(request_headers().SerializeToString())
    assert not done
    assert pb.ProcessingResponse.FromString(answers[0]).HasField("request_headers")
    answers, done = stream.on_message(b"\xff\xff not a protobuf")
    assert done
    answer = pb.ProcessingResponse.FromString(answers[0])
    assert answer.immediate_response.status.code == 500
    stream.on_close()


async def _start_grpc_aio(processor: Processor) -> tuple[int, grpc.aio.Server]:
    server = grpc_server(reuse_port=False)
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
        ExternalProcessor(processor), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return port, server


async def _start_builtin(processor: Processor) -> tuple[int, Http2Server]:
    server = Http2Server(http2_handlers(processor), max_message=1 << 20)
    return await server.start("127.0.0.1", 0), server


@pytest.mark.parametrize("start", [_start_builtin, _start_grpc_aio], ids=["builtin", "grpc-aio"])
async def test_a_bug_costs_one_request_not_the_stream_or_the_server(start) -> None:  # type: ignore[no-untyped-def]
    processor = make_processor()
    processor.gateway = Gateway.serving(
        ExplodingRouter(POOL, processor.gateway.routers[POOL].pods, random.Random(1)))
    port, server = await start(processor)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = external_processor_pb2_grpc.ExternalProcessorStub(channel)
            for _ in range(2):
                call = stub.Process()
                await call.write(request_headers())
                assert (await call.read()).HasField("request_headers")
                await call.write(request_body(b'{"model": "plain"}'))
                answer = await call.read()
                assert answer.immediate_response.status.code == 500
                assert msgspec.json.decode(answer.immediate_response.body)["error"]["code"] == (
                    "picker_error")
                await call.done_writing()
                assert await call.code() == grpc.StatusCode.OK
    finally:
        await server.stop(0)


async def _in_flight_settles(processor: Processor) -> dict[str, int]:
    """The in-flight counts once the server has closed its streams (it may lag the client by
    a loop turn or two; 2 s at most)."""
    for _ in range(200):
        if not processor.gateway.in_flight():
            break
        await asyncio.sleep(0.01)  # the pod table has no event to wait on
    return processor.gateway.in_flight()


@pytest.mark.parametrize("start", [_start_builtin, _start_grpc_aio], ids=["builtin", "grpc-aio"])
async def test_a_stream_that_routes_twice_leaves_nothing_in_flight(start) -> None:  # type: ignore[no-untyped-def]
    processor = make_processor()
    port, server = await start(processor)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = external_processor_pb2_grpc.ExternalProcessorStub(channel)
            call = stub.Process()
            for body in (b'{"model": "plain"}', b'{"model": "chat"}', b'{"model": "plain"}'):
                await call.write(request_headers())
                assert (await call.read()).HasField("request_headers")
                await call.write(request_body(body))
                assert (await call.read()).request_body.response.header_mutation.set_headers
                assert processor.gateway.in_flight() == {"pod-a": 1}
            # a bodiless request routed on its headers, on the same stream
            await call.write(request_headers(end_of_stream=True))
            assert (await call.read()).request_headers.response.header_mutation.set_headers
            assert processor.gateway.in_flight() == {"pod-a": 1}
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK
        assert await _in_flight_settles(processor) == {}
    finally:
        await server.stop(0)


def test_only_the_newest_routing_of_a_stream_asks_for_the_response_rewrite() -> None:
    exchange = Exchange(make_processor())
    exchange.handle(request_headers())
    (routed,) = exchange.handle(request_body(b'{"model": "chat"}'))
    assert routed.request_body.response.body_mutation.body  # rewritten to chat-v2
    exchange.handle(request_headers())
    exchange.handle(request_body(b'{"model": "plain"}'))
    (answer,) = exchange.handle(response_headers(b"application/json"))
    assert answer == exchange._p.response_headers_continue  # no rewrite of "plain"'s response
    exchange.close()
    assert exchange._p.gateway.in_flight() == {}


@pytest.mark.parametrize("start", [_start_builtin, _start_grpc_aio], ids=["builtin", "grpc-aio"])
async def test_hostile_bodies_get_a_400_or_pass_through_and_the_stream_stays_healthy(start) -> None:  # type: ignore[no-untyped-def]
    processor = make_processor()
    port, server = await start(processor)
    deep = b'{"model": "chat", "x": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    huge_number = b'{"model": "chat", "x": 1e400, "s": "\xff"}'
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = external_processor_pb2_grpc.ExternalProcessorStub(channel)
            for body in (deep, huge_number, b'{"model": "plain"}'):
                call = stub.Process()
                await call.write(request_headers())
                await call.read()
                await call.write(request_body(body))
                answer = await call.read()
                await call.done_writing()
                assert await call.code() == grpc.StatusCode.OK
                if body is deep:
                    immediate = answer.immediate_response
                    assert immediate.status.code == 400
                    assert msgspec.json.decode(immediate.body)["error"]["code"] == "json_too_deep"
                elif body is huge_number:
                    assert answer.request_body.response.body_mutation.body == (
                        b'{"model":"chat-v2","x":1e400,"s":"\xff"}')
                else:
                    assert answer.request_body.response.header_mutation.set_headers
        assert await _in_flight_settles(processor) == {}
    finally:
        await server.stop(0)
