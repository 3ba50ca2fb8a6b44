"""How the picker reads a request body it was not told the mode of, a repeated end of stream,
and the conformance suite's test headers: the pure per-stream logic (:class:`Exchange`) with real
protobuf messages and no network. Through a real picker process and Envoy:
``tests/test_picker_peer_sequences.py``."""

from __future__ import annotations

import msgspec
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from services.picker import conformance, epp
from services.picker.ext_proc import BUFFERED, DUPLEX, MAX_HELD_BODY, Exchange, Mode, Processor
from shared.schemas import Endpoint
from tests.support import peer_sequences
from tests.test_picker_epp_units import (
    HEADER,
    body_message,
    destination,
    headers_message,
    make_processor,
    pods_of,
)

BEST = "10.0.0.0:8000"  # pod-0: the shortest queue of make_processor's pods


def _run(exchange: Exchange, messages: list[pb.ProcessingRequest]
         ) -> list[tuple[pb.ProcessingResponse, ...]]:
    """Each message's answers, in order."""
    return [exchange.handle(message) for message in messages]


def _kinds(answers: tuple[pb.ProcessingResponse, ...]) -> list[str | None]:
    return [answer.WhichOneof("response") for answer in answers]


def _body_destination(answer: pb.ProcessingResponse) -> str | None:
    for option in answer.request_body.response.header_mutation.set_headers:
        if option.header.key == HEADER:
            return option.header.raw_value.decode()
    return None


def _error_code(answer: pb.ProcessingResponse) -> str:
    code: str = msgspec.json.decode(answer.immediate_response.body)["error"]["code"]
    return code


# --- no protocol_config: the peer's sequences ------------------------------------------------


def test_the_peers_split_body_is_assembled_and_routed_once() -> None:
    """llm-d's "split body across chunks": before, each chunk was routed alone (two 400s)."""
    processor = make_processor()
    exchange = Exchange(processor)
    headers, first, last = _run(exchange, peer_sequences.raw(peer_sequences.SPLIT_HEADERS,
                                                             *peer_sequences.SPLIT_BODY))
    assert _kinds(headers) == ["request_headers"]
    assert first == ()  # its answer waits for the whole body
    # One answer per chunk (the protocol outside FULL_DUPLEX_STREAMED); the destination rides
    # on the first, which Envoy reads before it forwards anything.
    assert _kinds(last) == ["request_body", "request_body"]
    assert _body_destination(last[0]) == BEST
    assert _body_destination(last[1]) is None
    assert not any(answer.HasField("immediate_response") for answer in (*headers, *last))
    assert pods_of(processor).in_flight() == {"pod-0": 1}
    exchange.close()
    assert pods_of(processor).in_flight() == {}


def test_a_split_body_whose_model_is_rewritten_replaces_the_last_chunk() -> None:
    exchange = Exchange(make_processor())
    *_, last = _run(exchange, peer_sequences.raw({}, '{"model": "ch', 'at", "prompt": "x"',
                                                 "}"))
    assert _kinds(last) == ["request_body"] * 3
    first, middle, final = last
    assert _body_destination(first) == BEST
    assert first.request_body.response.body_mutation.clear_body
    assert middle.request_body.response.body_mutation.clear_body
    new_body = final.request_body.response.body_mutation.body
    assert msgspec.json.decode(new_body) == {"model": "chat-v2", "prompt": "x"}
    lengths = {o.header.key: o.header.raw_value
               for o in first.request_body.response.header_mutation.set_headers}
    assert lengths["content-length"] == str(len(new_body)).encode()


def test_a_body_sent_whole_without_protocol_config_is_answered_at_once() -> None:
    """The peer's ``ReqLLM`` (and Envoy before 1.34 in BUFFERED mode): one answer, routed."""
    exchange = Exchange(make_processor())
    headers, (answer,) = _run(exchange, peer_sequences.llm("test1", "premium"))
    assert _kinds(headers) == ["request_headers"]
    assert _body_destination(answer) == BEST


def test_a_broken_split_body_gets_one_immediate_response() -> None:
    exchange = Exchange(make_processor())
    *_, first, last = _run(exchange, peer_sequences.raw({}, "no healthy", " upstream"))
    assert first == ()
    (answer,) = last
    assert answer.immediate_response.status.code == 400
    assert _error_code(answer) == "invalid_json"


def test_a_streamed_body_beyond_the_limit_is_refused_once() -> None:
    exchange = Exchange(make_processor())
    exchange.handle(peer_sequences.headers_message({}))
    chunk = b" " * (1 << 20)
    answers = [exchange.handle(body_message(chunk, False))
               for _ in range(MAX_HELD_BODY // len(chunk) + 3)]
    answers.append(exchange.handle(body_message(b"}", True)))
    refusals = [a for replies in answers for a in replies]
    assert len(refusals) == 1
    assert refusals[0].immediate_response.status.code == 413
    assert _error_code(refusals[0]) == "request_too_large"


def test_trailers_end_a_streamed_body_without_protocol_config() -> None:
    exchange = Exchange(make_processor())
    exchange.handle(peer_sequences.headers_message({}))
    assert exchange.handle(body_message(b'{"model": "premium"}', False)) == ()
    answers = exchange.handle(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    assert _kinds(answers) == ["request_body", "request_trailers"]
    assert _body_destination(answers[0]) == BEST


def test_a_new_request_on_the_stream_starts_a_new_body() -> None:
    processor = make_processor()
    exchange = Exchange(processor)
    for _ in range(2):
        *_, last = _run(exchange, peer_sequences.raw({}, '{"model": ', '"premium"}'))
        assert _body_destination(last[0]) == BEST
    assert pods_of(processor).in_flight() == {"pod-0": 1}  # the first one was replaced


def test_told_buffered_a_chunk_without_end_of_stream_is_still_routed_at_once() -> None:
    """BUFFERED sends a body followed by trailers without end of stream; it is whole."""
    exchange = Exchange(make_processor())
    exchange.handle(headers_message(BUFFERED))
    (answer,) = exchange.handle(body_message(b'{"model": "premium"}', False))
    assert _body_destination(answer) == BEST


# --- a repeated end of stream (Envoy issue #46237) -------------------------------------------


def test_full_duplex_repeated_last_chunk_is_not_routed_again() -> None:
    processor = make_processor()
    exchange = Exchange(processor)
    assert exchange.handle(headers_message(DUPLEX)) == ()
    body = msgspec.json.encode({"model": "chat", "prompt": "p" * 1_200_000})
    middle = len(body) // 2
    assert exchange.handle(body_message(body[:middle], False)) == ()
    answers = exchange.handle(body_message(body[middle:], True))
    assert _kinds(answers)[0] == "request_headers"
    assert destination(answers[0]) == BEST
    sent_back = b"".join(a.request_body.response.body_mutation.streamed_response.body
                         for a in answers[1:])
    assert msgspec.json.decode(sent_back)["model"] == "chat-v2"
    # Envoy sends the last chunk again, with end of stream: nothing is answered (the body went
    # back already, and FULL_DUPLEX_STREAMED expects no answer per message); not a second
    # decision, and the response is still handled.
    assert exchange.handle(body_message(body[middle:], True)) == ()
    assert pods_of(processor).in_flight() == {"pod-0": 1}
    response = pb.ProcessingRequest()
    response.response_headers.headers.headers.add(key=":status", raw_value=b"200")
    assert _kinds(exchange.handle(response)) == ["response_headers"]


@pytest.mark.parametrize("told", [True, False], ids=["buffered", "no-protocol-config"])
def test_a_repeated_end_in_other_modes_gets_an_empty_answer(told: bool) -> None:
    processor = make_processor()
    exchange = Exchange(processor)
    exchange.handle(headers_message(BUFFERED) if told else peer_sequences.headers_message({}))
    (routed,) = exchange.handle(body_message(b'{"model": "premium"}', True))
    assert _body_destination(routed) == BEST
    (again,) = exchange.handle(body_message(b'{"model": "premium"}', True))
    assert again == processor.request_body_continue  # one answer per message, changing nothing
    assert pods_of(processor).in_flight() == {"pod-0": 1}


# --- the conformance suite's test headers ----------------------------------------------------


def _selection(value: str) -> conformance.Selection | None:
    return conformance.selection(peer_sequences.headers_message(
        {conformance.SELECTION_HEADER: value}).request_headers)


def test_selection_header_parsing_and_matching() -> None:
    assert _selection("") is None and _selection(" , ") is None
    assert conformance.selection(peer_sequences.headers_message({}).request_headers) is None
    selection = _selection("10.0.0.1, 10.0.0.2:8000,[fd00::1]:3000,fd00::2,[fd00::3]")
    assert selection is not None
    assert selection.hosts == {"10.0.0.1", "fd00::2", "fd00::3"}
    assert selection.hostports == {("10.0.0.2", "8000"), ("fd00::1", "3000")}
    endpoints = [Endpoint("a", "10.0.0.1", 8000), Endpoint("b", "10.0.0.1", 8001),
                 Endpoint("c", "10.0.0.2", 8000), Endpoint("d", "10.0.0.2", 8001),
                 Endpoint("e", "fd00::1", 3000), Endpoint("f", "10.0.0.9", 8000)]
    assert selection.members(endpoints) == {"10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.2:8000",
                                            "fd00::1:3000"}


def _conformance_processor(on: bool = True) -> Processor:
    processor = make_processor()
    processor.conformance = on
    return processor


def _route_with(processor: Processor, value: str, mode: int = BUFFERED,
                subset: list[str] | None = None) -> pb.ProcessingResponse:
    """The routing answer to a request whose selection header is ``value``."""
    exchange = Exchange(processor)
    exchange.handle(headers_message(mode, {conformance.SELECTION_HEADER: value}, subset))
    answers = exchange.handle(body_message(b'{"model": "premium"}', True))
    return answers[0]


def test_the_selection_header_is_ignored_without_the_flag() -> None:
    answer = _route_with(_conformance_processor(on=False), "10.0.0.3")
    assert _body_destination(answer) == BEST


def test_the_selection_header_chooses_among_the_pool_members_it_names() -> None:
    processor = _conformance_processor()
    assert _body_destination(_route_with(processor, "10.0.0.3")) == "10.0.0.3:8000"
    # Among those named, the policy decides (pod-2 has the shorter queue); a name outside the
    # pool is left out, as the suite's two-pool test needs.
    assert _body_destination(_route_with(processor, "10.0.0.3:8000, 10.0.0.2,10.9.9.9")) == (
        "10.0.0.2:8000")
    # FULL_DUPLEX_STREAMED: the held headers answer carries it.
    assert destination(_route_with(processor, "10.0.0.3", DUPLEX)) == "10.0.0.3:8000"
    # With the gateway's subset hint too, both apply.
    assert _body_destination(_route_with(processor, "10.0.0.2,10.0.0.3",
                                         subset=["10.0.0.1:8000", "10.0.0.3:8000"])) == (
        "10.0.0.3:8000")


@pytest.mark.parametrize("value", ["10.0.0.3:9999", "10.9.9.9", "not-an-address"])
def test_a_selection_naming_no_pool_member_is_refused(value: str) -> None:
    answer = _route_with(_conformance_processor(), value)
    assert answer.immediate_response.status.code == 400
    error = msgspec.json.decode(answer.immediate_response.body)["error"]
    assert error["code"] == "test_endpoint_not_in_pool"
    assert conformance.SELECTION_HEADER in error["message"] and "pool-a" in error["message"]


def test_the_response_headers_carry_the_served_endpoint() -> None:
    processor = _conformance_processor()
    exchange = Exchange(processor)
    (asked,) = exchange.handle(headers_message(BUFFERED))
    # Envoy must send the response headers to this stream to get the header.
    assert asked.mode_override.response_header_mode == Mode.SEND
    exchange.handle(body_message(b'{"model": "premium"}', True))
    response = pb.ProcessingRequest()
    response.response_headers.headers.headers.add(key=":status", raw_value=b"200")
    lb = response.metadata_context.filter_metadata[epp.LB_NAMESPACE]
    lb.fields[epp.SERVED_KEY].string_value = "10.0.0.2:8000"
    (answer,) = exchange.handle(response)
    served = {o.header.key: o.header.raw_value
              for o in answer.response_headers.response.header_mutation.set_headers}
    assert served == {conformance.SERVED_HEADER: b"10.0.0.2:8000"}
    assert processor.response_headers_continue.response_headers.response.header_mutation \
        .set_headers == []  # the shared answer is left alone


@pytest.mark.parametrize("namespace", [False, True])
def test_a_served_endpoint_not_reported_says_what_is_missing(namespace: bool) -> None:
    exchange = Exchange(_conformance_processor())
    exchange.handle(headers_message(BUFFERED))
    exchange.handle(body_message(b'{"model": "premium"}', True))
    response = pb.ProcessingRequest()
    response.response_headers.headers.headers.add(key=":status", raw_value=b"200")
    if namespace:
        response.metadata_context.filter_metadata[epp.LB_NAMESPACE].SetInParent()
    (answer,) = exchange.handle(response)
    (option,) = answer.response_headers.response.header_mutation.set_headers
    assert option.header.raw_value == (conformance.MISSING_SERVED if namespace
                                       else conformance.MISSING_NAMESPACE)
