"""The ext_proc message sequences the llm-d router's EPP integration tests send, built as they
build them (``test/integration/util.go`` of llm-d/llm-d-inference-scheduler: ``ReqRaw``,
``ReqLLM``, ``ReqHeaderOnly``).

What sets them apart from Envoy's: no ``protocol_config`` on the first message, header values in
``value`` (not ``raw_value``), request headers without ``end_of_stream`` however many body chunks
follow, and every message written before any answer is read (``StreamedRequest``).
"""

from __future__ import annotations

import json

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

# The headers of their "split body across chunks" case (hermetic_test.go), and its body as the
# two chunks it is sent in.
SPLIT_HEADERS = {"hi": "mom", "x-gateway-inference-objective": "sql-lora-sheddable",
                 "x-gateway-model-name-rewrite": "sql-lora-1fdg3",
                 "x-request-id": "test-request-id"}
SPLIT_BODY = ('{"max_tokens":100,"model":"sql-lo',
              'ra-sheddable","prompt":"test6","temperature":0}')


def headers_message(headers: dict[str, str], end_of_stream: bool = False
                    ) -> pb.ProcessingRequest:
    """Request headers as the peer builds them: values in ``value``, no protocol_config."""
    message = pb.ProcessingRequest()
    message.request_headers.end_of_stream = end_of_stream
    for key, value in headers.items():
        message.request_headers.headers.headers.add(key=key, value=value)
    return message


def raw(headers: dict[str, str], *chunks: str | bytes) -> list[pb.ProcessingRequest]:
    """``ReqRaw``: the headers, then each chunk, ``end_of_stream`` on the last only."""
    messages = [headers_message(headers)]
    for index, chunk in enumerate(chunks):
        body = chunk.encode() if isinstance(chunk, str) else chunk
        messages.append(pb.ProcessingRequest(request_body=pb.HttpBody(
            body=body, end_of_stream=index == len(chunks) - 1)))
    return messages


def llm(prompt: str, model: str) -> list[pb.ProcessingRequest]:
    """``ReqLLM``: the standard headers, then the whole JSON body in one chunk."""
    body = json.dumps({"max_tokens": 100, "model": model, "prompt": prompt, "temperature": 0},
                      separators=(",", ":"), sort_keys=True)
    return raw({"hi": "mom", "x-request-id": "test-request-id"}, body)


def header_only(headers: dict[str, str]) -> list[pb.ProcessingRequest]:
    """``ReqHeaderOnly``: request headers ending the stream."""
    return [headers_message(headers, end_of_stream=True)]
