"""Asking a running picker's ext_proc server for a route, as Envoy's routing filter does."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

DESTINATION = "x-gateway-destination-endpoint"
REWRITE = "x-gateway-model-rewrite"
BUFFERED = 1  # ProcessingMode.BodySendMode.BUFFERED


@dataclass(frozen=True)
class Route:
    """The picker's answer: the destination it set, or the status of its immediate response;
    ``rewrite``: the requested name it asks Envoy to put back in the response (percent-encoded),
    when it sent the request to another target model."""

    destination: str | None
    status: int | None
    rewrite: str | None = None


def _headers(path: bytes) -> pb.ProcessingRequest:
    headers = pb.ProcessingRequest()
    for key, value in ((":method", b"POST"), (":path", path)):
        headers.request_headers.headers.headers.add(key=key, raw_value=value)
    headers.protocol_config.request_body_mode = BUFFERED
    return headers


def _answer(answer: pb.ProcessingResponse) -> Route:
    if answer.HasField("immediate_response"):
        return Route(None, answer.immediate_response.status.code)
    mutation = answer.request_body.response.header_mutation
    found = {o.header.key: o.header.raw_value for o in mutation.set_headers}
    destination: bytes | None = found.get(DESTINATION)
    rewrite: bytes | None = found.get(REWRITE)
    return Route(destination.decode() if destination is not None else None, None,
                 rewrite.decode() if rewrite is not None else None)


def route_sync(port: int, body: bytes, path: bytes = b"/v1/completions",
               rpc_timeout_s: float = 5.0) -> Route:
    """:func:`route` for synchronous tests: asks one picker (behind Envoy, a test cannot
    choose which replica answers). The stream ends with the answer, so the request does not
    stay in the picker's in-flight counts."""
    body_message = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        answers = list(external_processor_pb2_grpc.ExternalProcessorStub(channel).Process(
            iter([_headers(path), body_message]), timeout=rpc_timeout_s))
    return _answer(next((a for a in answers if a.HasField("immediate_response")), answers[-1]))


async def route(port: int, body: bytes, path: bytes = b"/v1/completions",
                rpc_timeout_s: float = 5.0) -> Route:
    """Send request headers then a buffered ``body`` on one ext_proc stream to
    ``127.0.0.1:port``; the picker's routing answer."""
    headers = _headers(path)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = external_processor_pb2_grpc.ExternalProcessorStub(channel).Process(
            timeout=rpc_timeout_s)
        await call.write(headers)
        answer = await call.read()
        if answer.HasField("immediate_response"):
            await call.done_writing()
            return Route(None, answer.immediate_response.status.code)
        await call.write(pb.ProcessingRequest(
            request_body=pb.HttpBody(body=body, end_of_stream=True)))
        answer = await call.read()
        await call.done_writing()
    return _answer(answer)


async def exchange(port: int, messages: list[pb.ProcessingRequest],
                   rpc_timeout_s: float = 10.0) -> list[pb.ProcessingResponse]:
    """Write every message of ``messages`` on one ext_proc stream before reading anything (as
    the llm-d router's EPP tests do), then response headers as a marker; every answer the
    picker sent before the marker's, in order.

    The picker answers a stream's messages in order, so the marker's answer tells that nothing
    more will come for the others: no waiting for answers that should not come."""
    marker = pb.ProcessingRequest()
    marker.response_headers.headers.headers.add(key=":status", raw_value=b"200")
    answers: list[pb.ProcessingResponse] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = external_processor_pb2_grpc.ExternalProcessorStub(channel).Process(
            timeout=rpc_timeout_s)
        for message in (*messages, marker):
            await call.write(message)
        while True:
            answer = await call.read()
            assert answer is not grpc.aio.EOF, f"the stream ended after {answers}"
            if answer.HasField("response_headers"):
                break
            answers.append(answer)
        await call.done_writing()
    return answers
