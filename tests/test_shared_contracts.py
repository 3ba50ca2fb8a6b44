"""Schemas round-trip through msgpack, bad payloads fail cleanly, names escape reversibly."""

from __future__ import annotations

import asyncio

import msgspec
import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.schemas import (
    SCHEMA_VERSION,
    Criticality,
    DecodeError,
    Endpoint,
    EndpointSet,
    InferenceModel,
    InferencePool,
    PodMetrics,
    TargetModel,
    decode,
    encode,
)
from shared.subjects import Subjects, endpoints_key, escape_token, model_key, unescape_token
from tests.support.nats_sync import synced
from tests.support.waiting import eventually


def test_messages_round_trip() -> None:
    messages = [
        PodMetrics(pool="p", pod="a.b*c", address="10.0.0.1:8000", seq=3, scrape_time_ns=1,
                   scrape_duration_s=0.002, ok=True, waiting=4, kv_cache_usage=0.5,
                   running_adapters=("sql-lora",), max_lora=4),
        InferenceModel(model_name="chat", pool="p", criticality=Criticality.SHEDDABLE,
                       target_models=(TargetModel("a", 70), TargetModel("b", 30))),
        InferencePool(name="p", target_port=8000, selector={"app": "vllm"}),
        EndpointSet(pool="p", endpoints=(Endpoint("pod-1", "127.0.0.1", 8000),)),
    ]
    for message in messages:
        assert decode(encode(message), type(message)) == message


def test_decode_rejects_garbage_and_other_versions() -> None:
    with pytest.raises(DecodeError):
        decode(b"\xc1not msgpack", PodMetrics)
    with pytest.raises(DecodeError):
        decode(msgspec.msgpack.encode({"pool": "p"}), PodMetrics)
    future = msgspec.structs.replace(EndpointSet(pool="p"), schema=SCHEMA_VERSION + 1)
    with pytest.raises(DecodeError, match="schema"):
        decode(encode(future), EndpointSet)


def test_pod_with_special_characters_maps_to_one_token() -> None:
    subjects = Subjects()
    subject = subjects.metrics("pool one", "a.b*c")
    assert subject.count(".") == 3 and "*" not in subject and " " not in subject
    assert subjects.parse_metrics(subject) == ("pool one", "a.b*c")
    assert model_key("p", "meta-llama/Llama-3.1-8B").count(".") == 2
    assert endpoints_key("p.q") == "endpoints.p=2Eq"


# No deadline, no speed health check: hypothesis' 200 ms per example (and its check on how
# fast examples are drawn) fail on a loaded machine; this test is about the escaping, not time.
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(min_size=1))
def test_escaping_is_reversible_and_kv_safe(name: str) -> None:
    token = escape_token(name)
    assert unescape_token(token) == name
    assert all(c.isascii() and (c.isalnum() or c in "-/_=") for c in token)


async def test_escaped_subject_routes_on_a_real_server(nats_server) -> None:
    subjects = Subjects()
    client = await nats.connect(nats_server.url)
    try:
        received: asyncio.Queue[str] = asyncio.Queue()

        async def handler(msg) -> None:
            await received.put(msg.subject)

        subscription = await client.subscribe(subjects.pool_metrics("pool one"), cb=handler)
        await client.publish(subjects.metrics("pool one", "a.b*c >"), b"x")
        await client.publish(subjects.metrics("other", "a"), b"x")
        await eventually(lambda: not received.empty(), within=10, what="the message routed")
        subject = received.get_nowait()
        assert subjects.parse_metrics(subject) == ("pool one", "a.b*c >")
        await synced(client)  # everything routed to this connection has been read
        assert subscription.delivered == 1
    finally:
        await client.close()
