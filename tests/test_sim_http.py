"""``lig sim`` over real HTTP: OpenAI API shapes, SSE streams, errors, metrics pages, faults."""

from __future__ import annotations

import argparse
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.vllm_metrics import parse_vllm_metrics
from simulator import main as sim_main
from tests.support.simulator import SimulatedPods

MODEL = "sim-model"
ADAPTERS = ("sql-lora", "chat-lora")


@pytest.fixture(scope="module")
def pods() -> Iterator[SimulatedPods]:
    """Two V1 pods with two adapters, one adapter per batch."""
    with SimulatedPods(2, loras=ADAPTERS, max_loras=1, time_scale=20, model=MODEL) as started:
        yield started


@pytest.fixture(scope="module")
def v0_pod() -> Iterator[SimulatedPods]:
    with SimulatedPods(1, loras=ADAPTERS, time_scale=20, metrics_format="v0") as started:
        yield started


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10.0) as http:
        yield http


def sse_payloads(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of a complete SSE body, checking the framing of every event."""
    assert response.headers["content-type"].startswith("text/event-stream")
    body = response.read().decode()
    assert body.endswith("\n\n")
    payloads = []
    for event in body.split("\n\n")[:-1]:
        assert event.startswith("data: "), event
        payloads.append(event.removeprefix("data: "))
    assert payloads[-1] == "[DONE]"
    return payloads[:-1]


def metrics(client: httpx.Client, url: str) -> bytes:
    response = client.get(url + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return response.content


def sample(page: bytes, name: str, **labels: str) -> float:
    """One sample's value, found with prometheus_client's parser."""
    for family in text_string_to_metric_families(page.decode()):
        for found in family.samples:
            if found.name == name and labels.items() <= found.labels.items():
                return found.value
    raise KeyError(name)


def test_health_and_models(pods: SimulatedPods, client: httpx.Client) -> None:
    assert client.get(pods.url(1) + "/health").status_code == 200
    listing = client.get(pods.url(0) + "/v1/models").json()
    assert listing["object"] == "list"
    cards = {card["id"]: card for card in listing["data"]}
    assert set(cards) == {MODEL, *ADAPTERS}
    assert cards[MODEL]["parent"] is None and cards["sql-lora"]["parent"] == MODEL
    assert all(card["object"] == "model" for card in cards.values())


def test_completion_has_max_tokens_tokens_and_openai_usage(
    pods: SimulatedPods, client: httpx.Client
) -> None:
    body = {"model": MODEL, "prompt": "Say hello to the simulator.", "max_tokens": 7}
    answer = client.post(pods.url(0) + "/v1/completions", json=body).json()
    assert answer["object"] == "text_completion" and answer["id"].startswith("cmpl-")
    assert answer["model"] == MODEL and isinstance(answer["created"], int)
    (choice,) = answer["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert len(choice["text"].split()) == 7
    usage = answer["usage"]
    assert usage["completion_tokens"] == 7 and usage["prompt_tokens"] == 7  # 5 words + 2 marks
    assert usage["total_tokens"] == 14


def test_without_max_tokens_the_output_length_is_drawn_and_stops(
    pods: SimulatedPods, client: httpx.Client
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write anything."}]}
    answer = client.post(pods.url(0) + "/v1/chat/completions", json=body).json()
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["role"] == "assistant"
    tokens = answer["usage"]["completion_tokens"]
    assert tokens >= 1 and len(choice["message"]["content"].split()) == tokens


def test_streamed_completion_is_valid_sse_with_a_usage_chunk(
    pods: SimulatedPods, client: httpx.Client
) -> None:
    body = {
        "model": "sql-lora",
        "prompt": [101, 102, 103, 104],
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", pods.url(1) + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        chunks = [json.loads(payload) for payload in sse_payloads(response)]
    *tokens, last = chunks
    assert len(tokens) == 12
    assert {chunk["id"] for chunk in chunks} == {chunks[0]["id"]}
    for index, chunk in enumerate(tokens):
        assert chunk["object"] == "text_completion" and chunk["model"] == "sql-lora"
        (choice,) = chunk["choices"]
        assert choice["index"] == 0 and isinstance(choice["text"], str) and choice["text"]
        assert choice["finish_reason"] == ("length" if index == 11 else None)
        assert chunk["usage"] is None
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 12,
        "total_tokens": 16,
        "prompt_tokens_details": None,
    }


def test_with_prompt_tokens_details_usage_reports_the_prefix_cache_hit(
    client: httpx.Client
) -> None:
    """As vLLM with --enable-prompt-tokens-details: the prompt tokens found cached, whole 16-token
    blocks of at most all but the last token; in full in a body, without nulls in a stream."""
    prompt = list(range(1000, 1100))  # 100 tokens: 6 full blocks cacheable (96 tokens)
    with SimulatedPods(1, time_scale=20, extra_args=("--enable-prompt-tokens-details",)) as pod:
        url = pod.url(0) + "/v1/completions"
        reported = []
        for _ in range(2):
            usage = client.post(url, json={"prompt": prompt, "max_tokens": 2}).json()["usage"]
            reported.append(usage["prompt_tokens_details"])
        stream = {"prompt": prompt, "max_tokens": 2, "stream": True,
                  "stream_options": {"include_usage": True}}
        with client.stream("POST", url, json=stream) as response:
            last = json.loads(sse_payloads(response)[-1])
    assert reported == [
        {"cached_tokens": 0, "created_cache_tokens": None, "multimodal_tokens": None},
        {"cached_tokens": 96, "created_cache_tokens": None, "multimodal_tokens": None}]
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 96}


def test_streamed_chat_opens_with_the_role_and_ends_with_the_reason(
    pods: SimulatedPods, client: httpx.Client
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_completion_tokens": 5,
        "stream": True,
    }
    with client.stream("POST", pods.url(0) + "/v1/chat/completions", json=body) as response:
        chunks = [json.loads(payload) for payload in sse_payloads(response)]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert all("usage" not in chunk for chunk in chunks)  # not asked for
    first, *tokens = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(tokens) == 5
    content = "".join(chunk["choices"][0]["delta"]["content"] for chunk in tokens)
    assert len(content.split()) == 5 and not content.startswith(" ")
    assert [chunk["choices"][0]["finish_reason"] for chunk in tokens] == [None] * 4 + ["length"]


def test_unknown_adapter_gets_vllms_404(pods: SimulatedPods, client: httpx.Client) -> None:
    body = {"model": "no-such-lora", "prompt": "x", "max_tokens": 2}
    response = client.post(pods.url(0) + "/v1/completions", json=body)
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model `no-such-lora` does not exist.",
            "type": "NotFoundError",
            "param": None,
            "code": 404,
        }
    }


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b'["a list"]', "JSON object"),
        (b'{"model": "sim-model"}', "prompt must be"),
        (b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
        (b'{"prompt": "x", "max_tokens": 200000}', "maximum context length"),
        (b'{"prompt": "x", "stream_options": {"include_usage": true}}', "stream=True"),
    ],
)
def test_bad_bodies_get_400_in_the_error_shape(
    pods: SimulatedPods, client: httpx.Client, body: bytes, message: str
) -> None:
    response = client.post(pods.url(0) + "/v1/completions", content=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert message in error["message"]


def raw_exchange(port: int, data: bytes) -> bytes:
    """Send raw bytes, close our side, and read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"GARBAGE\r\n\r\n", b"400"),
        (b"GET /health HTTP/9.9\r\n\r\n", b"400"),
        (b"GET /health HTTP/1.1\r\nno colon here\r\n\r\n", b"400"),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n", b"413"),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 12\r\n\r\nshort", None),
        (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", b"431"),
    ],
)
def test_malformed_requests_get_an_error_and_the_server_survives(
    pods: SimulatedPods, client: httpx.Client, data: bytes, status: bytes | None
) -> None:
    answer = raw_exchange(pods.ports[0], data)
    if status is None:
        assert answer == b""  # the body never completed: nothing to answer
    else:
        assert answer.startswith(b"HTTP/1.1 " + status)
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == int(status)
    assert client.get(pods.url(0) + "/health").status_code == 200


def test_keep_alive_chunked_bodies_and_expect_continue(pods: SimulatedPods) -> None:
    body = b'{"prompt": "a b c", "max_tokens": 2}'
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    requests = (
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        + b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        + chunked
        + b"POST /v1/completions HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: %d\r\n"
        % len(body)
        + b"Connection: close\r\n\r\n"
        + body
    )
    answer = raw_exchange(pods.ports[1], requests)
    assert answer.count(b"HTTP/1.1 200 OK") == 3
    assert answer.count(b"HTTP/1.1 100 Continue") == 1
    assert answer.count(b'"completion_tokens":2') == 2


def test_unknown_paths_and_methods(pods: SimulatedPods, client: httpx.Client) -> None:
    assert client.get(pods.url(0) + "/v2/nothing").status_code == 404
    assert client.get(pods.url(0) + "/v1/completions").status_code == 405


def scrape_both(page: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """The gateway's fields as read by prometheus_client's parser and by the project's parser."""
    families = {family.name: family for family in text_string_to_metric_families(page.decode())}

    def value(name: str) -> float:
        return families[name].samples[0].value

    kv_name = "vllm:kv_cache_usage_perc"
    if kv_name not in families:
        kv_name = "vllm:gpu_cache_usage_perc"
    newest = max(families["vllm:lora_requests_info"].samples, key=lambda s: s.value).labels
    cache = families["vllm:cache_config_info"].samples[0].labels
    reference = {
        "waiting": int(value("vllm:num_requests_waiting")),
        "running": int(value("vllm:num_requests_running")),
        "kv_cache_usage": value(kv_name),
        "running_adapters": tuple(filter(None, newest["running_lora_adapters"].split(","))),
        "waiting_adapters": tuple(filter(None, newest["waiting_lora_adapters"].split(","))),
        "max_lora": int(newest["max_lora"]),
        "block_size": int(cache["block_size"]),
        "num_gpu_blocks": int(cache["num_gpu_blocks"]),
    }
    parsed = parse_vllm_metrics(page)
    assert parsed.missing == ()
    ours = {field: getattr(parsed, field) for field in reference}
    return reference, ours


@pytest.mark.parametrize("fmt", ["v1", "v0"])
def test_metrics_parse_to_the_same_values_with_both_parsers_while_busy(
    pods: SimulatedPods, v0_pod: SimulatedPods, client: httpx.Client, fmt: str
) -> None:
    url = pods.url(0) if fmt == "v1" else v0_pod.url(0)
    body = {"model": "chat-lora", "prompt": "long " * 300, "max_tokens": 50_000, "stream": True}
    with httpx.Client(timeout=10.0) as streamer, streamer.stream(
        "POST", url + "/v1/completions", json=body
    ) as response:
        lines = response.iter_lines()  # kept: dropping it would close the stream
        assert next(lines).startswith("data: ")  # the request is running now
        page = metrics(client, url)
        reference, ours = scrape_both(page)
    assert ours == reference
    assert reference["running"] == 1 and reference["running_adapters"] == ("chat-lora",)
    assert 0 < reference["kv_cache_usage"] < 0.05
    assert reference["block_size"] == 16 and reference["num_gpu_blocks"] == 28_000
    assert (b'engine="0"' in page) == (fmt == "v1")
    assert (b"vllm:kv_cache_usage_perc{" in page) == (fmt == "v1")
    assert (b"vllm:gpu_cache_usage_perc{" in page) == (fmt == "v0")

    # The client went away: the request is aborted and the pod is idle again.
    deadline = time.monotonic() + 10
    while True:
        page = metrics(client, url)
        reference, ours = scrape_both(page)
        if reference["running"] == 0:
            break
        assert time.monotonic() < deadline, "the aborted request kept running"
        time.sleep(0.02)
    assert ours == reference and reference["running_adapters"] == ()
    assert sample(page, "vllm:request_success_total", finished_reason="abort") >= 1
    assert reference["kv_cache_usage"] == 0.0


def test_counters_and_histograms_account_every_request(
    pods: SimulatedPods, client: httpx.Client
) -> None:
    url = pods.url(1)
    before = metrics(client, url)
    prompt = completion = 0
    for index in range(5):
        body = {"model": MODEL, "prompt": f"request number {index} here", "max_tokens": 3 + index}
        usage = client.post(url + "/v1/completions", json=body).json()["usage"]
        prompt += usage["prompt_tokens"]
        completion += usage["completion_tokens"]
    after = metrics(client, url)

    def grew(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert grew("vllm:prompt_tokens_total") == prompt
    assert grew("vllm:generation_tokens_total") == completion
    assert grew("vllm:request_success_total", finished_reason="length") == 5
    assert grew("vllm:time_to_first_token_seconds_count") == 5
    assert grew("vllm:inter_token_latency_seconds_count") == completion - 5
    assert grew("vllm:e2e_request_latency_seconds_count") == 5
    assert grew("vllm:prefix_cache_queries_total") == prompt
    buckets = [
        s.value
        for family in text_string_to_metric_families(after.decode())
        for s in family.samples
        if s.name == "vllm:e2e_request_latency_seconds_bucket"
    ]
    assert buckets == sorted(buckets) and buckets[-1] == sample(
        after, "vllm:e2e_request_latency_seconds_count"
    )


def test_lora_requests_info_keeps_every_combination(
    pods: SimulatedPods, client: httpx.Client
) -> None:
    url = pods.url(1)
    for adapter in ADAPTERS:
        body = {"model": adapter, "prompt": "adapter traffic", "max_tokens": 3}
        assert client.post(url + "/v1/completions", json=body).status_code == 200
    series = [
        s
        for family in text_string_to_metric_families(metrics(client, url).decode())
        for s in family.samples
        if s.name == "vllm:lora_requests_info"
    ]
    running = {s.labels["running_lora_adapters"] for s in series}
    assert {"sql-lora", "chat-lora", ""} <= running
    assert all(s.labels["max_lora"] == "1" for s in series)
    assert all(s.value > 1.7e9 for s in series)  # unix times
    newest = max(series, key=lambda s: s.value)
    assert newest.labels["running_lora_adapters"] == newest.labels["waiting_lora_adapters"] == ""


def test_faults_set_at_run_time(pods: SimulatedPods, client: httpx.Client) -> None:
    url = pods.url(1)
    body = {"prompt": "x", "max_tokens": 1}
    try:
        assert pods.set_faults(1, failure_rate=1.0)["failure_rate"] == 1.0
        failed = client.post(url + "/v1/completions", json=body)
        assert failed.status_code == 500
        assert failed.json()["error"]["type"] == "InternalServerError"
        assert client.post(pods.url(0) + "/v1/completions", json=body).status_code == 200

        pods.set_faults(1, failure_rate=0.0, metrics_delay=0.3)
        started = time.monotonic()
        metrics(client, url)
        assert time.monotonic() - started >= 0.3

        pods.set_faults(1, metrics_delay=0.0, hang=True)
        with pytest.raises(httpx.ReadTimeout):
            client.post(url + "/v1/completions", json=body, timeout=0.3)
        with pytest.raises(httpx.ReadTimeout):
            client.get(url + "/metrics", timeout=0.3)
        assert client.get(url + "/admin/faults").json()["hang"] is True
        bad = client.post(url + "/admin/faults", json={"failure_rate": 2})
        assert bad.status_code == 400 and "failure_rate" in bad.json()["error"]["message"]
        assert client.post(url + "/admin/faults", json={"nope": 1}).status_code == 400
    finally:
        pods.set_faults(1, failure_rate=0.0, metrics_delay=0.0, hang=False)
    assert client.post(url + "/v1/completions", json=body).status_code == 200


def test_pods_are_independent(pods: SimulatedPods, client: httpx.Client) -> None:
    before = sample(metrics(client, pods.url(1)), "vllm:generation_tokens_total")
    body = {"prompt": "only pod zero", "max_tokens": 4}
    assert client.post(pods.url(0) + "/v1/completions", json=body).status_code == 200
    assert sample(metrics(client, pods.url(1)), "vllm:generation_tokens_total") == before


def test_invalid_settings_are_refused_before_serving() -> None:
    parser = argparse.ArgumentParser()
    sim_main.configure(parser)
    for argv in (["--pods", "0"], ["--time-scale", "0"], ["--lora", "a", "--lora", "a"],
                 ["--profile", "no-such-profile"], ["--base-port", "65535", "--pods", "2"]):
        with pytest.raises(ValueError):
            sim_main.settings_from_args(parser.parse_args(argv))
    settings = sim_main.settings_from_args(parser.parse_args(["--pods", "3", "--lora", "a"]))
    assert [pod.index for pod in settings] == [0, 1, 2]
    assert settings[0].engine.adapters == ("a",)


@pytest.mark.parametrize("mode", ["hang", "error"])
def test_a_gray_pod_reports_idle_metrics_but_fails_completions(
        client: httpx.Client, mode: str) -> None:
    body = {"prompt": "x", "max_tokens": 1}
    with SimulatedPods(2, time_scale=20, model=MODEL,
                       extra_args=("--gray-pod", "1", "--gray-mode", mode)) as gray:
        assert client.post(gray.url(0) + "/v1/completions", json=body).status_code == 200
        if mode == "hang":
            with pytest.raises(httpx.ReadTimeout):
                client.post(gray.url(1) + "/v1/completions", json=body, timeout=0.5)
        else:
            # Answered, not hung: the hang mode times out where this one says 500.
            failed = client.post(gray.url(1) + "/v1/completions", json=body, timeout=5.0)
            assert failed.status_code == 500
        page = metrics(client, gray.url(1))  # answered at once, and idle
        assert sample(page, "vllm:num_requests_running") == 0
        assert sample(page, "vllm:num_requests_waiting") == 0
        assert client.get(gray.url(1) + "/admin/faults").json()["gray"] == mode
        assert gray.set_faults(1, gray="")["gray"] == ""  # healed at run time
        assert client.post(gray.url(1) + "/v1/completions", json=body).status_code == 200
        assert client.post(gray.url(0) + "/admin/faults",
                           json={"gray": "sometimes"}).status_code == 400


def test_gray_pod_must_name_a_pod() -> None:
    parser = argparse.ArgumentParser()
    sim_main.configure(parser)
    with pytest.raises(ValueError, match="--gray-pod"):
        sim_main.settings_from_args(parser.parse_args(["--pods", "2", "--gray-pod", "2"]))
    settings = sim_main.settings_from_args(parser.parse_args(
        ["--pods", "3", "--gray-pod", "1", "--gray-mode", "error"]))
    assert [pod.faults.gray for pod in settings] == ["", "error", ""]
