"""The endpoint picker protocol's pure logic: metadata parsing, fallbacks, served-endpoint
accounting and FULL_DUPLEX_STREAMED answers, with real protobuf messages and no network."""

from __future__ import annotations

import random

import msgspec
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from prometheus_client import CollectorRegistry

from services.picker import epp
from services.picker.ext_proc import DUPLEX, DUPLEX_CHUNK, MAX_HELD_BODY, Exchange, Processor
from services.picker.observability import PickerMetrics
from services.picker.pools import Gateway
from services.picker.routing import Routed, Router
from services.picker.state import PodTable
from shared.registry_view import RegistryView
from shared.schemas import (
    Criticality,
    Endpoint,
    EndpointSet,
    InferenceModel,
    InferencePool,
    PodMetrics,
    PolicyConfig,
    TargetModel,
)

POOL = "pool-a"
HEADER = "x-gateway-destination-endpoint"
# waiting per pod: pod-0 best, then pod-1, pod-2, pod-3.
WAITING = {"pod-0": 0, "pod-1": 2, "pod-2": 4, "pod-3": 6}


def make_processor(fallbacks: int = 0, policy: str = "least-queue",
                   objectives: dict[str, Criticality] | None = None) -> Processor:
    pods = PodTable(stale_after=60.0)
    router = Router(POOL, pods, random.Random(1), fallbacks=fallbacks)
    view = RegistryView()
    view.pools[POOL] = InferencePool(name=POOL, target_port=8000, policy=PolicyConfig(policy),
                                     objectives=objectives or {})
    view.models[POOL] = {
        "chat": InferenceModel(model_name="chat", pool=POOL,
                               target_models=(TargetModel("chat-v2", 1),)),
        "bulk": InferenceModel(model_name="bulk", pool=POOL, criticality=Criticality.SHEDDABLE),
        "premium": InferenceModel(model_name="premium", pool=POOL,
                                  criticality=Criticality.CRITICAL),
    }
    view.endpoints[POOL] = EndpointSet(pool=POOL, endpoints=tuple(
        Endpoint(name, f"10.0.0.{i}", 8000) for i, name in enumerate(WAITING)))
    router.update(view)
    for i, (name, waiting) in enumerate(WAITING.items()):
        pods.apply(PodMetrics(pool=POOL, pod=name, address=f"10.0.0.{i}:8000", seq=1,
                              scrape_time_ns=1, scrape_duration_s=0.0, ok=True,
                              waiting=waiting))
    return Processor(Gateway.serving(router), PickerMetrics(CollectorRegistry()), HEADER)


def pods_of(processor: Processor) -> PodTable:
    """The one pool's pod table."""
    table = processor.gateway.table(POOL)
    assert table is not None
    return table


def headers_message(mode: int, headers: dict[str, str] | None = None,
                    subset: list[str] | None = None) -> pb.ProcessingRequest:
    message = pb.ProcessingRequest()
    for key, value in {":method": "POST", **(headers or {})}.items():
        header = message.request_headers.headers.headers.add()
        header.key, header.raw_value = key, value.encode()
    message.protocol_config.request_body_mode = mode
    message.protocol_config.response_body_mode = mode
    if subset is not None:
        hint = message.metadata_context.filter_metadata[epp.SUBSET_NAMESPACE]
        hint.fields[epp.SUBSET_KEY].list_value.values.extend(
            struct_pb2.Value(string_value=item) for item in subset)
    return message


def body_message(body: bytes, end: bool, response: bool = False) -> pb.ProcessingRequest:
    message = pb.ProcessingRequest()
    part = message.response_body if response else message.request_body
    part.body, part.end_of_stream = body, end
    return message


def destination(reply: pb.ProcessingResponse) -> str:
    headers = reply.request_headers.response.header_mutation.set_headers
    return next(h.header.raw_value.decode() for h in headers if h.header.key == HEADER)


def test_subset_hint_parsing() -> None:
    metadata = base_pb2.Metadata()
    assert epp.subset_hint(metadata) is None
    hint = metadata.filter_metadata[epp.SUBSET_NAMESPACE]
    hint.fields[epp.SUBSET_KEY].string_value = "10.0.0.1:8000, 10.0.0.2:8000"
    assert epp.subset_hint(metadata) == {"10.0.0.1:8000", "10.0.0.2:8000"}
    hint.fields[epp.SUBSET_KEY].list_value.SetInParent()
    assert epp.subset_hint(metadata) == frozenset()  # present and empty: nothing is eligible


def test_fallbacks_follow_policy_order_and_stay_in_the_subset() -> None:
    processor = make_processor(fallbacks=2)
    routed = processor.route(b'{"model": "chat"}')
    assert isinstance(routed, Routed)
    assert (routed.endpoint, routed.fallbacks) == ("10.0.0.0:8000",
                                                   ("10.0.0.1:8000", "10.0.0.2:8000"))
    hinted = processor.route(b'{"model": "chat"}', frozenset({"10.0.0.3:8000", "10.0.0.2:8000"}))
    assert isinstance(hinted, Routed)
    assert (hinted.endpoint, hinted.fallbacks) == ("10.0.0.2:8000", ("10.0.0.3:8000",))
    none = processor.route(b'{"model": "chat"}', frozenset())
    assert not isinstance(none, Routed) and none.status == 503


def test_duplex_answers_headers_then_streamed_body_then_trailers() -> None:
    processor = make_processor(fallbacks=1)
    exchange = Exchange(processor)
    assert exchange.handle(headers_message(DUPLEX)) == ()
    prompt = "p" * (DUPLEX_CHUNK + 10)
    body = msgspec.json.encode({"model": "chat", "prompt": prompt})
    assert exchange.handle(body_message(body[:100], False)) == ()
    assert exchange.handle(body_message(body[100:], False)) == ()
    trailers = pb.ProcessingRequest()
    trailers.request_trailers.SetInParent()
    replies = exchange.handle(trailers)
    kinds = [reply.WhichOneof("response") for reply in replies]
    assert kinds == ["request_headers", "request_body", "request_body", "request_trailers"]
    assert destination(replies[0]) == "10.0.0.0:8000,10.0.0.1:8000"
    lb = replies[0].dynamic_metadata.fields[epp.LB_NAMESPACE].struct_value.fields[HEADER]
    assert lb.string_value == "10.0.0.0:8000,10.0.0.1:8000"
    chunks = [r.request_body.response.body_mutation.streamed_response for r in replies[1:3]]
    sent = b"".join(chunk.body for chunk in chunks)
    assert msgspec.json.decode(sent) == {"model": "chat-v2", "prompt": prompt}
    assert [chunk.end_of_stream for chunk in chunks] == [False, False]  # trailers follow


def test_duplex_response_chunks_come_back_rewritten() -> None:
    exchange = Exchange(make_processor())
    exchange.handle(headers_message(DUPLEX))
    exchange.handle(body_message(b'{"model": "chat"}', True))
    response = pb.ProcessingRequest()
    header = response.response_headers.headers.headers.add()
    header.key, header.raw_value = "content-type", b"application/json"
    (reply,) = exchange.handle(response)
    assert list(reply.response_headers.response.header_mutation.remove_headers) == [
        "content-length"]
    assert exchange.handle(body_message(b'{"model": "chat', False, response=True))[
        0].response_body.response.body_mutation.streamed_response.body == b""
    (last,) = exchange.handle(body_message(b'-v2"}', True, response=True))
    streamed = last.response_body.response.body_mutation.streamed_response
    assert (msgspec.json.decode(streamed.body), streamed.end_of_stream) == ({"model": "chat"},
                                                                           True)


def test_served_endpoint_moves_the_request_to_the_pod_that_served_it() -> None:
    processor = make_processor(fallbacks=1)
    exchange = Exchange(processor)
    exchange.handle(headers_message(DUPLEX))
    exchange.handle(body_message(b'{"model": "chat"}', True))
    assert pods_of(processor).in_flight() == {"pod-0": 1}
    response = pb.ProcessingRequest()
    response.response_headers.SetInParent()
    served = response.metadata_context.filter_metadata[epp.LB_NAMESPACE]
    served.fields[epp.SERVED_KEY].string_value = "10.0.0.1:8000"
    exchange.handle(response)
    assert pods_of(processor).in_flight() == {"pod-1": 1}
    views = {view.name: view for view in pods_of(processor).fresh_views()}
    assert (views["pod-0"].waiting, views["pod-1"].waiting) == (0, 3)  # load estimate moved
    exchange.close()
    assert pods_of(processor).in_flight() == {}


def saturated(processor: Processor) -> Processor:
    """Every pod saturated for sheddable requests."""
    for name in WAITING:
        pods_of(processor).apply(PodMetrics(pool=POOL, pod=name, address="", seq=2,
                                            scrape_time_ns=2, scrape_duration_s=0.0, ok=True,
                                            waiting=500, kv_cache_usage=0.99))
    return processor


def test_objective_header_names_an_objective_of_the_pool() -> None:
    # An InferenceObjective's own name (the Kubernetes source puts it in the pool's message),
    # which need not be a model name; it wins over a model of the same name.
    processor = saturated(make_processor(policy="filter-tree", objectives={
        "latency-critical": Criticality.CRITICAL, "premium": Criticality.SHEDDABLE}))
    outcomes = []
    for objective in ("latency-critical", "premium"):
        exchange = Exchange(processor)
        exchange.handle(headers_message(DUPLEX, {epp.OBJECTIVE_HEADERS[0]: objective}))
        (reply, *_) = exchange.handle(body_message(b'{"model": "bulk"}', True))
        outcomes.append(reply.WhichOneof("response"))
        exchange.close()
    assert outcomes == ["request_headers", "immediate_response"]


def test_objective_header_names_a_registered_model_whose_criticality_applies() -> None:
    processor = saturated(make_processor(policy="filter-tree"))
    for header in epp.OBJECTIVE_HEADERS:
        exchange = Exchange(processor)
        exchange.handle(headers_message(DUPLEX, {header: "premium"}))
        (reply, *_) = exchange.handle(body_message(b'{"model": "bulk"}', True))
        assert reply.WhichOneof("response") == "request_headers"
        exchange.close()
    exchange = Exchange(processor)
    exchange.handle(headers_message(DUPLEX, {epp.OBJECTIVE_HEADERS[0]: "unknown"}))
    (shed,) = exchange.handle(body_message(b'{"model": "bulk"}', True))
    assert shed.immediate_response.status.code == 429


def test_duplex_body_beyond_the_limit_is_answered_413_without_holding_it() -> None:
    processor = make_processor()
    exchange = Exchange(processor)
    exchange.handle(headers_message(DUPLEX))
    chunk = b" " * (1 << 20)
    replies: tuple[pb.ProcessingResponse, ...] = ()
    for _ in range(MAX_HELD_BODY // len(chunk) + 1):
        replies = exchange.handle(body_message(chunk, False))
        if replies:
            break
    (reply,) = replies
    assert reply.immediate_response.status.code == 413
    error = msgspec.json.decode(reply.immediate_response.body)["error"]
    assert (error["code"], error["type"]) == ("request_too_large", "invalid_request_error")
    assert pods_of(processor).in_flight() == {}


def test_duplex_trailers_without_a_body_are_answered_not_left_waiting() -> None:
    exchange = Exchange(make_processor())
    assert exchange.handle(headers_message(DUPLEX)) == ()
    trailers = pb.ProcessingRequest()
    trailers.request_trailers.SetInParent()
    (reply,) = exchange.handle(trailers)
    assert reply.immediate_response.status.code == 400  # no body: no model to route by
