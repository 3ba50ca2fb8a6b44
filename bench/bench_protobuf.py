"""Why the picker uses xds-protos: ext_proc message decode/encode time against envoy-data-plane.

Per HTTP request the picker decodes three ProcessingRequests (request headers, request body,
response headers) and encodes three ProcessingResponses (CONTINUE, the routing answer with header
mutation, body and dynamic metadata, CONTINUE). This times exactly that with both libraries on
identical wire bytes and prints the medians and their ratio.

Run: ``.venv/bin/python bench/bench_protobuf.py [--rounds 7] [--count 2000]``
(``envoy-data-plane`` comes with the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import msgspec
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

PROMPT = "Summarise the benefits of load balancing for LLM inference. " * 4


def wire_messages() -> tuple[list[bytes], list[bytes]]:
    """Serialized requests Envoy sends and responses the picker sends, for one HTTP request."""
    body = msgspec.json.encode({"model": "chat", "prompt": PROMPT, "max_tokens": 16})
    headers = pb.ProcessingRequest()
    for key, value in ((":method", "POST"), (":path", "/v1/completions"), (":scheme", "http"),
                       (":authority", "gateway"), ("content-type", "application/json"),
                       ("content-length", str(len(body))), ("x-request-id", "4f1c9a"),
                       ("user-agent", "openai-python/1.40"), ("x-forwarded-proto", "http")):
        header = headers.request_headers.headers.headers.add()
        header.key, header.raw_value = key, value.encode()
    headers.protocol_config.request_body_mode = 2
    request_body = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    response_headers = pb.ProcessingRequest()
    for key, value in ((":status", "200"), ("content-type", "application/json"),
                       ("content-length", "312")):
        header = response_headers.response_headers.headers.headers.add()
        header.key, header.raw_value = key, value.encode()

    cont = pb.ProcessingResponse()
    cont.request_headers.response.clear_route_cache = True
    cont.request_headers.response.header_mutation.remove_headers.append(
        "x-gateway-destination-endpoint")
    routed = pb.ProcessingResponse()
    common = routed.request_body.response
    for key, raw in (("x-gateway-destination-endpoint", b"10.0.0.7:8000"),
                     ("content-length", str(len(body) + 3).encode())):
        option = common.header_mutation.set_headers.add()
        option.header.key, option.header.raw_value = key, raw
        option.append_action = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    common.body_mutation.body = body.replace(b'"chat"', b'"chat-v2"')
    common.clear_route_cache = True
    routed.dynamic_metadata.fields["envoy.lb"].struct_value.fields[
        "x-gateway-destination-endpoint"].string_value = "10.0.0.7:8000"
    response_continue = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
    requests = [m.SerializeToString() for m in (headers, request_body, response_headers)]
    responses = [m.SerializeToString() for m in (cont, routed, response_continue)]
    return requests, responses


def per_request_us(work: Callable[[], None], count: int, rounds: int) -> float:
    """Median over ``rounds`` of the time per call of ``work``, in microseconds."""
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(count):
            work()
        samples.append((time.perf_counter() - start) / count * 1e6)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--count", type=int, default=2000, help="iterations per round")
    args = parser.parse_args()
    try:
        from envoy_data_plane.envoy.service.ext_proc import v3 as edp
    except ImportError:
        print("envoy-data-plane is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 1

    requests, responses = wire_messages()
    upb_responses = [pb.ProcessingResponse.FromString(data) for data in responses]
    edp_responses = [edp.ProcessingResponse.parse(data) for data in responses]
    # Same content both ways (guards against timing two different things).
    for ours, theirs in zip(upb_responses, edp_responses, strict=True):
        assert pb.ProcessingResponse.FromString(bytes(theirs)) == ours

    def upb_decode() -> None:
        for data in requests:
            pb.ProcessingRequest.FromString(data)

    def upb_encode() -> None:
        for message in upb_responses:
            message.SerializeToString()

    def edp_decode() -> None:
        for data in requests:
            edp.ProcessingRequest.parse(data)

    def edp_encode() -> None:
        for message in edp_responses:
            bytes(message)

    rows = {name: per_request_us(work, args.count if "xds" in name else max(1, args.count // 10),
                                 args.rounds)
            for name, work in (("xds-protos decode", upb_decode),
                               ("xds-protos encode", upb_encode),
                               ("envoy-data-plane decode", edp_decode),
                               ("envoy-data-plane encode", edp_encode))}
    print(f"bench_protobuf: ext_proc messages of one HTTP request (3 decoded, 3 encoded); "
          f"medians of {args.rounds} rounds")
    for name, value in rows.items():
        print(f"  {name:26} {value:9.1f} us per request")
    upb = rows["xds-protos decode"] + rows["xds-protos encode"]
    edp_total = rows["envoy-data-plane decode"] + rows["envoy-data-plane encode"]
    print(f"  total: xds-protos {upb:.1f} us, envoy-data-plane {edp_total:.1f} us "
          f"(ratio {edp_total / upb:.0f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
