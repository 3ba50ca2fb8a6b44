"""The flight recorder on the picker side (pure logic): one DecisionRecord per scheduled request,
the draw that replays its pick, and the OutcomeRecord of a request that ended."""

from __future__ import annotations

import argparse
import random

import msgspec
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry

from scheduling import build_policy
from scheduling.record import DecisionRecord, OutcomeRecord, Record, RecordBatch
from scheduling.types import SchedulingRequest
from services.picker import epp
from services.picker.app import build_gateway, decision_publisher
from services.picker.ext_proc import (
    BUFFERED,
    DUPLEX,
    NONE,
    STREAMED,
    Exchange,
    Mode,
    Processor,
)
from services.picker.main import configure, settings_from
from services.picker.observability import PickerMetrics
from services.picker.pools import Gateway, ResponseSeen
from services.picker.routing import Rejected, Routed
from shared.schemas import (
    Criticality,
    Endpoint,
    EndpointSet,
    PodMetrics,
    PolicyConfig,
    decode,
    encode,
)
from shared.subjects import Subjects
from tests.test_picker_epp_units import HEADER, body_message, headers_message, make_processor
from tests.test_picker_routing import POOL, Fleet

LONG_PROMPT = "You are a helpful assistant. Answer in one line. " * 120  # several blocks


def pods(fleet: Fleet, count: int, **metrics: object) -> Fleet:
    """``count`` members p0.. with fresh snapshots (``waiting`` of pod i: its index when
    ``waiting`` is "index")."""
    fleet.view.endpoints[POOL] = EndpointSet(POOL, tuple(
        Endpoint(f"p{index}", "127.0.0.1", 8001 + index) for index in range(count)))
    fleet.router.update(fleet.view)
    for index in range(count):
        fleet.pods.apply(PodMetrics(POOL, f"p{index}", f"127.0.0.1:{8001 + index}", 1, 1, 0.0,
                                    True, **metrics))  # type: ignore[arg-type]
    return fleet


def recording(fleet: Fleet) -> list[tuple[str, Record]]:
    records: list[tuple[str, Record]] = []
    fleet.router.on_record = lambda pool, record: records.append((pool, record))
    return records


def replay(record: DecisionRecord, config: PolicyConfig) -> str | None:
    """The draw contract, as `lig replay --what-if` applies it."""
    rng = random.Random()
    policy = build_policy(config, rng)
    rng.seed(record.draw)
    request = SchedulingRequest(record.model, record.target_model, record.criticality,
                                record.prompt_tokens, record.max_tokens,
                                tuple(range(record.prefix_blocks)), record.prefix_hits)
    pick = policy.schedule(request, record.view).pick
    return pick.name if pick is not None else None


def test_every_routed_decision_is_recorded_and_its_draw_replays_the_random_tie() -> None:
    # Four identical pods: the filter tree keeps them all and the pick is a uniform draw.
    fleet = pods(Fleet().model("chat", targets={"chat-a": 1, "chat-b": 1}), 4, waiting=1,
                 kv_cache_usage=0.1)
    records = recording(fleet)
    picks = []
    for number in range(200):
        routed = fleet.router.route(msgspec.json.encode(
            {"model": "chat", "prompt": "hello", "max_tokens": 7}), request_id=f"req-{number}")
        assert isinstance(routed, Routed)
        picks.append(routed.pod)
    assert len(records) == 200 and {pool for pool, _ in records} == {POOL}
    decisions = [record for _, record in records]
    assert all(isinstance(record, DecisionRecord) for record in decisions)
    first = decisions[0]
    assert isinstance(first, DecisionRecord)
    assert (first.request_id, first.model, first.max_tokens, first.policy, first.shed) == (
        "req-0", "chat", 7, fleet.router.policy.name, False)
    assert [view.name for view in first.view] == ["p0", "p1", "p2", "p3"]
    assert len(set(picks)) == 4  # the draw decides: every pod is picked at some point
    assert {record.target_model for record in decisions} == {"chat-a", "chat-b"}
    replayed = [replay(record, PolicyConfig()) for record in decisions]  # type: ignore[arg-type]
    assert replayed == [record.pick for record in decisions] == picks  # type: ignore[union-attr]
    assert len({record.seq for record in decisions}) == 200  # type: ignore[union-attr]


def test_the_prefix_aware_policy_replays_from_block_counts_and_hits() -> None:
    fleet = pods(Fleet(policy=PolicyConfig("prefix-aware")).model("chat"), 3, waiting=1,
                 kv_cache_usage=0.2)
    records = recording(fleet)
    body = msgspec.json.encode({"model": "chat", "prompt": LONG_PROMPT})
    for _ in range(30):
        assert isinstance(fleet.router.route(body), Routed)
    decisions = [record for _, record in records]
    later = decisions[-1]
    assert isinstance(later, DecisionRecord)
    assert later.prefix_blocks > 1 and later.prefix_hits  # the index matched earlier routes
    assert all(replay(record, PolicyConfig("prefix-aware")) == record.pick  # type: ignore[arg-type, union-attr]
               for record in decisions)


def test_sheds_and_no_pod_answers_are_recorded_without_a_pick() -> None:
    fleet = (Fleet().model("batch", Criticality.SHEDDABLE)
             .pod("a", 8001, waiting=30, kv_cache_usage=0.95))
    records = recording(fleet)
    shed = fleet.router.route(b'{"model": "batch"}', request_id="shed-me")
    assert isinstance(shed, Rejected) and shed.status == 429
    empty = Fleet().model("chat")
    empty_records = recording(empty)
    assert isinstance(empty.router.route(b'{"model": "chat"}', request_id="none"), Rejected)
    (_, record), = records
    assert isinstance(record, DecisionRecord)
    assert (record.request_id, record.shed, record.pick, record.criticality) == (
        "shed-me", True, None, Criticality.SHEDDABLE)
    assert [view.name for view in record.view] == ["a"]
    assert replay(record, PolicyConfig()) is None
    (_, nothing), = empty_records
    assert isinstance(nothing, DecisionRecord)
    assert (nothing.request_id, nothing.view, nothing.pick, nothing.shed) == ("none", [], None,
                                                                              False)


def test_the_outcome_follows_when_the_request_ends() -> None:
    fleet = Fleet().model("chat").pod("a", 8001, waiting=0)
    records: list[tuple[str, Record]] = []
    gateway = Gateway([POOL], lambda pool: fleet.router,
                      on_record=lambda pool, record: records.append((pool, record)))
    gateway.update(fleet.view)
    routed = gateway.route(b'{"model": "chat", "prompt": "hi"}', request_id="abc")
    assert isinstance(routed, Routed)
    gateway.started(routed)
    seen = ResponseSeen(200)
    seen.first_byte_ns = routed.decided_ns + 3_000_000
    gateway.finished(routed, 11, 22, seen)
    decision, outcome = (record for _, record in records)
    assert isinstance(decision, DecisionRecord) and isinstance(outcome, OutcomeRecord)
    assert (outcome.request_id, outcome.seq, outcome.served, outcome.status,
            outcome.prompt_tokens, outcome.completion_tokens) == (
        "abc", decision.seq, "a", 200, 11, 22)
    assert outcome.ttfb_ms == 3.0 and outcome.duration_ms >= 0
    unknown = gateway.route(b'{"model": "chat"}', request_id="")
    assert isinstance(unknown, Routed)
    gateway.finished(unknown)
    last = records[-1][1]
    assert isinstance(last, OutcomeRecord)
    assert (last.status, last.ttfb_ms, last.prompt_tokens, last.completion_tokens) == (
        0, None, None, None)


def test_records_round_trip_through_a_batch_and_nothing_is_recorded_when_off() -> None:
    fleet = Fleet().model("chat").pod("a", 8001, waiting=0).pod("b", 8002, waiting=3)
    records = recording(fleet)
    assert isinstance(fleet.router.route(b'{"model": "chat"}', request_id="x"), Routed)
    batch = decode(encode(RecordBatch("me", POOL, 1, [record for _, record in records])),
                   RecordBatch)
    (decoded,) = batch.records
    assert isinstance(decoded, DecisionRecord)
    original = records[0][1]
    assert isinstance(original, DecisionRecord)
    assert decoded.view == tuple(original.view) and decoded.draw == original.draw
    fleet.router.on_record = None
    routed = fleet.router.route(b'{"model": "chat"}', request_id="y")
    assert isinstance(routed, Routed) and routed.decided_ns == 0 and len(records) == 1


def recording_processor(record_responses: bool) -> tuple[Processor, list[Record]]:
    processor = make_processor(fallbacks=1)
    records: list[Record] = []
    gateway = processor.gateway
    gateway.on_record = lambda pool, record: records.append(record)
    for router in gateway.routers.values():
        router.on_record = gateway.on_record
    return Processor(gateway, PickerMetrics(CollectorRegistry()), HEADER,
                     record_responses=record_responses), records


def response_headers(status: bytes, content_type: bytes) -> pb.ProcessingRequest:
    message = pb.ProcessingRequest()
    for key, value in ((":status", status), ("content-type", content_type)):
        header = message.response_headers.headers.headers.add()
        header.key, header.raw_value = key, value
    return message


def test_the_endpoint_picker_protocol_path_records_id_served_pod_status_and_usage() -> None:
    processor, records = recording_processor(record_responses=False)
    exchange = Exchange(processor)
    exchange.handle(headers_message(DUPLEX, {epp.REQUEST_ID_HEADER: "gw-7"}))
    exchange.handle(body_message(b'{"model": "chat"}', True))
    served = response_headers(b"200", b"application/json")
    served.metadata_context.filter_metadata[epp.LB_NAMESPACE].fields[
        epp.SERVED_KEY].string_value = "10.0.0.1:8000"  # the gateway used the fallback
    exchange.handle(served)
    exchange.handle(body_message(b'{"usage": {"prompt_tokens": 4, "completion_tokens": 9}}',
                                 True, response=True))
    exchange.close()
    decision, outcome = records
    assert isinstance(decision, DecisionRecord) and isinstance(outcome, OutcomeRecord)
    assert (decision.request_id, decision.pick, decision.fallbacks) == (
        "gw-7", "pod-0", ("10.0.0.1:8000",))
    assert (outcome.request_id, outcome.served, outcome.status, outcome.prompt_tokens,
            outcome.completion_tokens) == ("gw-7", "pod-1", 200, 4, 9)
    assert outcome.ttfb_ms is not None


@pytest.mark.parametrize(("content_type", "mode", "model"), [
    (b"application/json", BUFFERED, "premium"), (b"text/event-stream", STREAMED, "premium"),
    (b"application/json", BUFFERED, "chat")])  # chat is rewritten to chat-v2
def test_record_responses_asks_envoy_for_the_response_it_reads_usage_from(
        content_type: bytes, mode: int, model: str) -> None:
    processor, records = recording_processor(record_responses=True)
    exchange = Exchange(processor)
    request = headers_message(BUFFERED, {epp.REQUEST_ID_HEADER: "r-1"})
    request.protocol_config.response_body_mode = NONE  # as the shipped bootstrap asks
    (answer,) = exchange.handle(request)
    assert answer.mode_override.response_header_mode == Mode.SEND
    exchange.handle(body_message(b'{"model": "%s"}' % model.encode(), True))
    (reply,) = exchange.handle(response_headers(b"201", content_type))
    assert reply.mode_override.response_body_mode == mode
    usage = b'{"usage": {"prompt_tokens": 2, "completion_tokens": 3}}'
    chunk = b"data: " + usage + b"\n\ndata: [DONE]\n\n" if mode == STREAMED else usage
    (passed,) = exchange.handle(body_message(chunk, True, response=True))
    assert not passed.response_body.response.HasField("body_mutation")  # nothing changed
    exchange.close()
    outcome = records[-1]
    assert isinstance(outcome, OutcomeRecord)
    assert (outcome.request_id, outcome.status, outcome.completion_tokens) == ("r-1", 201, 3)
    # The routing stream read the usage, so it counts the tokens, rewritten or not (the
    # rewrite is Envoy's: no other picker stream sees the response).
    counted = processor.metrics.tokens.labels(model, "completion")._value.get()
    assert counted == 3


@pytest.mark.parametrize(("argv", "env", "recording"), [
    ([], None, True), (["--no-record-decisions"], None, False), ([], "0", False),
    (["--record-decisions"], "0", True), (["--workers", "2", "--no-record-decisions"], None,
                                          False)])
def test_records_are_on_by_default_and_turned_off_by_flag_or_env(
        monkeypatch: pytest.MonkeyPatch, argv: list[str], env: str | None,
        recording: bool) -> None:
    if env is None:
        monkeypatch.delenv("LIG_RECORD_DECISIONS", raising=False)
    else:
        monkeypatch.setenv("LIG_RECORD_DECISIONS", env)
    parser = argparse.ArgumentParser()
    configure(parser)
    settings = settings_from(parser.parse_args([*argv, "--pool", POOL, "--shared-decisions"]))
    metrics = PickerMetrics(CollectorRegistry())
    publishing = decision_publisher(settings, Subjects(), metrics)
    assert publishing is not None and publishing.decisions is not None
    assert (publishing.records is not None) is recording
    gateway = build_gateway(settings, metrics, publishing)
    assert gateway.on_record is publishing.records
    both_off = settings_from(parser.parse_args(["--pool", POOL, "--no-shared-decisions",
                                                "--no-record-decisions"]))
    assert decision_publisher(both_off, Subjects(), metrics) is None


def served_twice(processor: Processor, usage: bytes) -> None:
    """The same long prompt twice to pod-0 (the gateway's subset hint), each response carrying
    ``usage``, over the endpoint picker protocol (the responses pass the routing stream)."""
    body = msgspec.json.encode({"model": "premium", "prompt": LONG_PROMPT})
    for _ in range(2):
        exchange = Exchange(processor)
        exchange.handle(headers_message(DUPLEX, subset=["10.0.0.0:8000"]))
        exchange.handle(body_message(body, True))
        exchange.handle(response_headers(b"200", b"application/json"))
        exchange.handle(body_message(usage, True, response=True))
        exchange.close()


def reuse_counters(processor: Processor) -> tuple[float, float, float]:
    metrics = processor.metrics
    return tuple(counter.labels(POOL)._value.get() for counter in (  # type: ignore[return-value]
        metrics.reused_predicted, metrics.reused_observed, metrics.reused_reports))


def test_the_outcome_and_the_pool_counters_hold_observed_and_predicted_reuse() -> None:
    processor, records = recording_processor(record_responses=False)
    served_twice(processor, b'{"usage": {"prompt_tokens": 700, "completion_tokens": 9, '
                            b'"prompt_tokens_details": {"cached_tokens": 640}}}')
    decisions = [r for r in records if isinstance(r, DecisionRecord)]
    first, second = [r for r in records if isinstance(r, OutcomeRecord)]
    assert [d.pick for d in decisions] == ["pod-0", "pod-0"]
    assert first.predicted_cached_tokens == 0  # nothing routed there before
    assert decisions[1].prefix_hits["pod-0"] == decisions[1].prefix_blocks > 0
    predicted = second.predicted_cached_tokens
    assert predicted is not None and 0 < predicted <= decisions[1].prompt_tokens
    assert (first.cached_tokens, second.cached_tokens) == (640, 640)
    assert reuse_counters(processor) == (predicted, 2 * 640, 2)


@pytest.mark.parametrize("details", [b"", b', "prompt_tokens_details": null'])
def test_responses_without_cached_tokens_count_in_neither_counter(details: bytes) -> None:
    processor, records = recording_processor(record_responses=False)
    served_twice(processor, b'{"usage": {"prompt_tokens": 700, "completion_tokens": 9%s}}'
                 % details)
    outcomes = [r for r in records if isinstance(r, OutcomeRecord)]
    assert [o.cached_tokens for o in outcomes] == [None, None]
    assert outcomes[1].predicted_cached_tokens  # the prediction is recorded regardless
    assert reuse_counters(processor) == (0, 0, 0)


def test_an_outcome_recorded_before_the_cache_fields_decodes_with_none() -> None:
    old = msgspec.msgpack.encode(["o", "r-1", 3, "pod-0", 200, 1.5, 9.0, 4, 2])
    outcome = msgspec.msgpack.decode(old, type=OutcomeRecord)
    assert (outcome.completion_tokens, outcome.cached_tokens,
            outcome.predicted_cached_tokens) == (2, None, None)
