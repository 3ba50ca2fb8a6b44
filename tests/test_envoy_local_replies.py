"""Envoy's own replies and the response rewrite, through a real Envoy, pickers and NATS.

Raw sockets on loopback send what an HTTP client library would refuse to (HTTP/1.0, 60 KiB of
headers, Content-Length with Transfer-Encoding, 2,000 headers, 33 MiB bodies): every one must get
a status line and the OpenAI error shape, never an empty reply. A picker killed while the pods
generate must not leave the target model's name in the responses (killed while they stream:
``test_response_model_names.py``).
"""

from __future__ import annotations

import select
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from tests.support.waiting import wait_until
from tests.test_picker_e2e import Stack, build_stack

BODY = b'{"model": "plain", "prompt": "hi"}'
CLEAN_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"


class RawReply(msgspec.Struct):
    """One HTTP/1.1 response read off a socket."""

    status: int
    headers: dict[str, str]
    body: bytes


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    built = build_stack(tmp_path_factory.mktemp("local-replies"), pods=2)
    try:
        yield built
    finally:
        built.close()


def raw_exchange(port: int, head: bytes, body: bytes = b"", chunk: int = 1 << 20,
                 timeout: float = 10.0) -> RawReply:
    """Send ``head`` and ``body`` (chunk by chunk, stopping early once Envoy has answered, as it
    does for a body it refuses) and read the reply until Envoy closes the connection."""
    deadline = time.monotonic() + timeout
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        for start in range(0, len(body), chunk):
            if select.select([sock], [], [], 0)[0]:
                break  # answered already
            try:
                sock.sendall(body[start:start + chunk])
            except (BrokenPipeError, ConnectionResetError):
                break
        data = b""
        while time.monotonic() < deadline:
            try:
                received = sock.recv(1 << 16)
            except ConnectionResetError:
                break
            if not received:
                break
            data += received
            if _complete(data):
                break
    assert data, "empty reply"
    head_bytes, _, rest = data.partition(b"\r\n\r\n")
    status_line, *lines = head_bytes.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return RawReply(int(status_line.split()[1]), headers, rest)


def _complete(data: bytes) -> bool:
    head, found, rest = data.partition(b"\r\n\r\n")
    if not found:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(rest) >= int(value)
    return False


def assert_openai_error(reply: RawReply, status: int, code: str) -> dict[str, str]:
    assert reply.status == status, reply
    assert reply.headers["content-type"] == "application/json"
    assert "x-gateway-local-reply" not in reply.headers  # the internal marker stays internal
    error = msgspec.json.decode(reply.body)["error"]
    assert set(error) == {"message", "type", "code"} and error["code"] == code, error
    return error


@pytest.mark.parametrize("head, status, code", [
    (b"POST /v1/completions HTTP/1.0\r\nHost: gateway\r\nContent-Length: %d\r\n\r\n"
     % len(BODY), 426, "http_version_not_supported"),
    (CLEAN_HEAD + b"X-Big: " + b"a" * (61 * 1024) + b"\r\nContent-Length: %d\r\n\r\n"
     % len(BODY), 431, "headers_too_large"),
    (CLEAN_HEAD + b"".join(b"X-H%d: v\r\n" % i for i in range(2000))
     + b"Content-Length: %d\r\n\r\n" % len(BODY), 431, "headers_too_large"),
    (CLEAN_HEAD + b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(BODY),
     400, "bad_request"),
    (b"NOT-HTTP\r\n\r\n", 400, "bad_request"),
], ids=["http-1.0", "61-KiB-header", "2000-headers", "content-length-and-chunked", "garbage"])
def test_requests_envoy_refuses_get_a_status_and_the_openai_shape(
        stack: Stack, head: bytes, status: int, code: str) -> None:
    assert stack.envoy is not None
    assert_openai_error(raw_exchange(stack.envoy.listen_port, head, BODY), status, code)


def test_a_body_over_32_mib_gets_a_json_413(stack: Stack) -> None:
    assert stack.envoy is not None
    size = 33 * 1024 * 1024
    body = b'{"model": "plain", "prompt": "' + b"x" * (size - 32) + b'"}'
    head = CLEAN_HEAD + b"Content-Length: %d\r\n\r\n" % len(body)
    error = assert_openai_error(raw_exchange(stack.envoy.listen_port, head, body), 413,
                                "request_too_large")
    assert "32 MiB" in error["message"]


def test_an_unreachable_model_server_gets_a_json_503(stack: Stack) -> None:
    assert stack.envoy is not None and stack.feed is not None
    dead = "127.0.0.1:9"  # discard port: nothing listens
    stack.feed.set_endpoints({"dead": dead})
    stack.feed.set_many({"dead": (dead, {"waiting": 0, "running": 0, "kv_cache_usage": 0.0})})
    try:
        stack.settle(lambda: stack.post().status_code == 503, "routed to the dead pod")
        reply = raw_exchange(stack.envoy.listen_port,
                             CLEAN_HEAD + b"Content-Length: %d\r\n\r\n" % len(BODY), BODY)
        assert_openai_error(reply, 503, "upstream_unavailable")
    finally:
        stack.reset()


def test_the_pickers_own_errors_keep_their_body(stack: Stack) -> None:
    stack.reset()
    stack.settle(lambda: stack.post().status_code == 200, "default state served")
    response = stack.post(content=b"{not json")
    assert response.status_code == 400
    assert "x-gateway-local-reply" not in response.headers
    assert response.json()["error"] == {"message": "request body is not valid JSON",
                                        "type": "invalid_request_error",
                                        "code": "invalid_json"}


def test_a_picker_killed_while_pods_generate_leaks_no_target_name(tmp_path: Path) -> None:
    stack = build_stack(tmp_path, pods=2, pickers=2)
    try:
        assert stack.feed is not None
        stack.feed.set_model("chat", target_models=[{"name": "chat-target", "weight": 1}])
        stack.settle(lambda: stack.post({"model": "chat"}).json()["model"] == "chat",
                     "chat rewritten")
        for pod in stack.upstreams:
            pod.delay = 1.5  # generating: routed, the responses still to come
        results: list[tuple[int, str]] = []

        def send(stream: bool) -> None:
            response = stack.post({"model": "chat", "prompt": "hi", "stream": stream})
            models = ([msgspec.json.decode(line[6:])["model"]
                       for line in response.text.splitlines() if line.startswith("data: {")]
                      if stream else [response.json()["model"]])
            results.extend((response.status_code, model) for model in models)

        clients = [threading.Thread(target=send, args=(index % 2 == 0,)) for index in range(12)]
        before = sum(pod.count for pod in stack.upstreams)
        for thread in clients:
            thread.start()
        wait_until(lambda: sum(pod.count for pod in stack.upstreams) == before + 12,
                   what="all routed")
        stack.pickers[0].signal(signal.SIGKILL)  # half the requests were routed by it
        stack.pickers[0].wait(5)
        for thread in clients:
            thread.join(15)
        assert len(results) == 6 + 6 * 3  # six JSON answers, six streams of three events
        assert set(results) == {(200, "chat")}
    finally:
        stack.close()
