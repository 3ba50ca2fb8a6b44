"""A real picker process against what others send it: the llm-d router's EPP test sequences over
gRPC (no ``protocol_config``, every message written before any answer is read), and the Gateway
API Inference Extension conformance suite's test headers through a real Envoy set up as a
gateway (the served endpoint reported, see ``tests/test_picker_epp.py``).

The pure logic behind both: ``tests/test_picker_body_modes.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgspec
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from services.picker import conformance
from services.picker.ext_proc import DUPLEX
from tests.support import peer_sequences
from tests.support.ext_proc_client import DESTINATION, exchange
from tests.test_picker_e2e import Stack
from tests.test_picker_epp import _start

MODEL = {"model": "plain", "prompt": "hi"}


def _destinations(answers: list[pb.ProcessingResponse]) -> list[str]:
    """Every destination the answers set, on the headers or a body answer."""
    found = []
    for answer in answers:
        kind = answer.WhichOneof("response")
        if kind in ("request_headers", "request_body"):
            common = getattr(answer, kind).response
            found += [o.header.raw_value.decode() for o in common.header_mutation.set_headers
                      if o.header.key == DESTINATION]
    return found


def _immediate(answers: list[pb.ProcessingResponse]) -> list[pb.ImmediateResponse]:
    return [a.immediate_response for a in answers if a.HasField("immediate_response")]


@pytest.fixture(scope="module")
def plain_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The picker without --conformance-test-headers, behind Envoy set up as a gateway."""
    stack = _start(tmp_path_factory.mktemp("peer"))
    try:
        stack.settle(lambda: stack.post(MODEL).status_code == 200, "served")
        yield stack
    finally:
        stack.close()


# --- the llm-d router's EPP test sequences ---------------------------------------------------


def test_the_peers_split_body_gets_one_routing_answer(plain_stack: Stack) -> None:
    port = plain_stack.pickers[0].grpc_port
    answers = asyncio.run(exchange(port, peer_sequences.raw(peer_sequences.SPLIT_HEADERS,
                                                            *peer_sequences.SPLIT_BODY)))
    assert _immediate(answers) == []
    # The headers answer, then one body answer per chunk; the destination set once.
    assert [a.WhichOneof("response") for a in answers] == [
        "request_headers", "request_body", "request_body"]
    (chosen,) = _destinations(answers)
    assert chosen in {u.address for u in plain_stack.upstreams}


def test_the_peers_whole_body_and_bodiless_sequences_are_routed(plain_stack: Stack) -> None:
    port = plain_stack.pickers[0].grpc_port
    members = {u.address for u in plain_stack.upstreams}
    answers = asyncio.run(exchange(port, peer_sequences.llm("test1", "plain")))
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    assert set(_destinations(answers)) <= members and len(_destinations(answers)) == 1
    answers = asyncio.run(exchange(port, peer_sequences.header_only(
        {"content-type": "application/json"})))
    (answer,) = answers
    assert _destinations([answer])[0] in members


def test_the_peers_broken_split_body_gets_one_immediate_response(plain_stack: Stack) -> None:
    answers = asyncio.run(exchange(plain_stack.pickers[0].grpc_port,
                                   peer_sequences.raw({"hi": "mom"}, "no healthy", " upstream")))
    (refused,) = _immediate(answers)
    assert refused.status.code == 400
    assert msgspec.json.decode(refused.body)["error"]["code"] == "invalid_json"
    assert [a.WhichOneof("response") for a in answers] == ["request_headers",
                                                           "immediate_response"]


def test_a_repeated_full_duplex_end_of_stream_is_routed_once(plain_stack: Stack) -> None:
    """Envoy issue #46237's sequence: the last chunk of a 1.2 MB body twice, with end of
    stream. One decision; nothing answers the repeat."""
    headers = pb.ProcessingRequest()
    headers.request_headers.headers.headers.add(key=":method", raw_value=b"POST")
    headers.protocol_config.request_body_mode = DUPLEX
    body = msgspec.json.encode({"model": "plain", "prompt": "p" * 1_200_000})
    last = pb.ProcessingRequest(request_body=pb.HttpBody(body=body[60_000:], end_of_stream=True))
    messages = [headers,
                pb.ProcessingRequest(request_body=pb.HttpBody(body=body[:60_000])), last, last]
    answers = asyncio.run(exchange(plain_stack.pickers[0].grpc_port, messages))
    assert _immediate(answers) == []
    assert answers[0].WhichOneof("response") == "request_headers"
    assert len(_destinations(answers)) == 1
    streamed = [a.request_body.response.body_mutation.streamed_response for a in answers[1:]]
    assert b"".join(s.body for s in streamed) == body
    assert [s.end_of_stream for s in streamed].count(True) == 1 and streamed[-1].end_of_stream


# --- the conformance suite's headers ---------------------------------------------------------


def test_the_selection_header_is_ignored_without_the_flag(plain_stack: Stack) -> None:
    stack = plain_stack
    stack.only_qualifies(0)
    stack.settle(lambda: stack.served_by()[0] == "pod-0", "pod-0 the best")
    worst = stack.pod(2).address
    response = stack.post(MODEL, headers={conformance.SELECTION_HEADER: worst})
    assert response.status_code == 200
    assert response.headers["x-upstream"] == "pod-0"
    assert conformance.SERVED_HEADER not in response.headers
    stack.reset()


@pytest.fixture(scope="module", params=["BUFFERED", "FULL_DUPLEX_STREAMED"])
def conformance_stack(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
                      ) -> Iterator[Stack]:
    """The picker with --conformance-test-headers behind Envoy set up as a gateway, in the
    shipped body mode and in the gateways' one."""
    stack = _start(tmp_path_factory.mktemp("conformance"), body_mode=request.param,
                   picker_args=("--conformance-test-headers",))
    try:
        stack.only_qualifies(0)
        stack.settle(lambda: stack.served_by()[0] == "pod-0", "pod-0 the best")
        yield stack
    finally:
        stack.close()


def test_the_selection_header_steers_and_the_served_endpoint_comes_back(
        conformance_stack: Stack) -> None:
    stack = conformance_stack
    for index in (2, 1):
        address = stack.pod(index).address
        # The suite sends the pod's IP alone, or IP:port; every pod here is on 127.0.0.1, so
        # the exact endpoint needs its port.
        response = stack.post(MODEL, headers={conformance.SELECTION_HEADER: address})
        assert response.status_code == 200, response.text
        assert response.headers["x-upstream"] == f"pod-{index}"
        assert response.headers[conformance.SERVED_HEADER] == address
    # Two named: only they serve (pod-0, the best, is not named).
    both = f"{stack.pod(1).address}, {stack.pod(2).address}"
    served = {stack.post(MODEL, headers={conformance.SELECTION_HEADER: both}).headers[
        "x-upstream"] for _ in range(10)}
    assert served <= {"pod-1", "pod-2"}
    # Without the header the policy decides, and the served endpoint is still reported.
    plain = stack.post(MODEL)
    assert plain.headers["x-upstream"] == "pod-0"
    assert plain.headers[conformance.SERVED_HEADER] == stack.pod(0).address


def test_a_selection_outside_the_pool_is_refused(conformance_stack: Stack) -> None:
    response = conformance_stack.post(MODEL, headers={
        conformance.SELECTION_HEADER: "127.0.0.1:1,10.255.0.1"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "test_endpoint_not_in_pool"
    assert conformance.SELECTION_HEADER in error["message"]


def test_a_large_body_is_steered_and_arrives_whole(conformance_stack: Stack) -> None:
    """1.2 MB, the size at which FULL_DUPLEX_STREAMED Envoys repeat the last chunk (#46237)."""
    stack = conformance_stack
    body = {"model": "plain", "prompt": "p" * 1_200_000}
    response = stack.post(body, headers={conformance.SELECTION_HEADER: stack.pod(1).address})
    assert response.status_code == 200, response.text
    assert response.headers["x-upstream"] == "pod-1"
    assert msgspec.json.decode(stack.pod(1).received[-1].body) == body


def test_start_warns_that_the_flag_is_on(conformance_stack: Stack) -> None:
    log = conformance_stack.pickers[0].log_path.read_text()
    assert "WARNING" in log and "--conformance-test-headers is on" in log
