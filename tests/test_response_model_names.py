"""No answer names another model, whatever dies: a picker SIGKILLed while rewritten responses
stream, through a real Envoy, two real ``lig picker`` processes, NATS and simulated vLLM pods;
and no request is lost with a picker that fails before routing it (killed or hung).

The registry sends ``tweet-summary`` to the target ``tweet-summary-1`` (the pods' model), so the
pods answer with the target's name and the gateway must put the requested one back: in every
JSON body and in every event of every stream, including the events that arrive after the
picker that routed the request (or, before issue 26, the one rewriting its events) died. An
answer that cannot be restored must end in an OpenAI-shaped error instead.
"""

from __future__ import annotations

import gzip
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from tests.support.envoy import EnvoyProcess, start_envoy
from tests.support.ext_proc_client import route_sync
from tests.support.fleet_feed import FleetFeed
from tests.support.nats_server import NatsServer
from tests.support.picker import PickerProcess
from tests.support.simulator import SimulatedPods
from tests.support.waiting import wait_until

POOL = "pool-names"
REQUESTED = "tweet-summary"
TARGET = "tweet-summary-1"
IDLE = {"waiting": 0, "running": 0, "kv_cache_usage": 0.0}
# About 0.12 s of wall time per generated token: 60 tokens stream for about 7 s, so the kill
# lands while every stream is still going, however loaded the machine (it only slows them).
TIME_SCALE = 0.05
STREAM_TOKENS = 60
IN_FLIGHT = 6  # of each kind: completions streams, chat streams, JSON completions


class Answer(msgspec.Struct):
    """One client's view of its answer: the status, and each line with when it arrived."""

    path: str
    stream: bool
    status: int = 0
    lines: list[tuple[float, str]] = msgspec.field(default_factory=list)
    body: bytes = b""
    failure: str = ""  # how the exchange broke off, if it did
    request_id: str = ""  # Envoy's x-request-id, to find the request in Envoy's log


def _send(url: str, answer: Answer) -> None:
    """Ask for ``answer``'s completion through the gateway at ``url``; fill ``answer`` in."""
    body: dict[str, Any] = {"model": REQUESTED, "max_tokens": STREAM_TOKENS,
                            "stream": answer.stream}
    if answer.path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "summarize this tweet"}]
    else:
        body["prompt"] = "summarize this tweet"
    try:
        with httpx.Client(base_url=url, timeout=60) as client, client.stream(
                "POST", answer.path, json=body) as response:
            answer.status = response.status_code
            answer.request_id = response.headers.get("x-request-id", "")
            if answer.stream:
                for line in response.iter_lines():
                    answer.lines.append((time.monotonic(), line))
            else:
                answer.body = response.read()
    except httpx.HTTPError as error:
        answer.failure = repr(error)


def _openai_error(document: Any) -> bool:
    """Whether ``document`` is an OpenAI-shaped error (``{"error": {message, type, code}}``)."""
    return (isinstance(document, dict) and set(document) == {"error"}
            and isinstance(document["error"], dict)
            and {"message", "type", "code"} <= set(document["error"]))


def _judge_stream(answer: Answer) -> str:
    """``restored`` (every event names the requested model, then [DONE]) or ``error`` (an
    OpenAI-shaped error event ends it); any other answer fails the test."""
    assert answer.status == 200, answer
    events = [line[6:] for _, line in answer.lines if line.startswith("data: ")]
    assert events, answer
    documents = [msgspec.json.decode(e) for e in events if e != "[DONE]"]
    if documents and _openai_error(documents[-1]):
        models = [d.get("model") for d in documents[:-1]]
        assert set(models) <= {REQUESTED}, f"{answer.path} names another model: {models}"
        return "error"
    assert events[-1] == "[DONE]", answer
    models = [d.get("model") for d in documents]
    assert models == [REQUESTED] * len(documents), f"{answer.path} names another model: {models}"
    return "restored"


def _judge_json(answer: Answer) -> str:
    """``restored`` or ``error``, as :func:`_judge_stream`, for a JSON answer."""
    document = msgspec.json.decode(answer.body)
    assert TARGET.encode() not in answer.body, f"names another model: {answer}"
    if answer.status == 200:
        assert document["model"] == REQUESTED, answer
        return "restored"
    assert _openai_error(document), answer
    return "error"


def _two_rewriting_pickers(feed: FleetFeed, pods: SimulatedPods, nats_url: str,
                           picker_process: Callable[..., PickerProcess]) -> list[PickerProcess]:
    """Two idle pods of ``POOL`` registered through ``feed``, ``REQUESTED`` sent to ``TARGET``,
    and two pickers that both resolve the name (before any request is judged)."""
    feed.set_pool()
    feed.set_model(REQUESTED, target_models=[{"name": TARGET, "weight": 1}])
    members = {f"pod-{i}": pods.address(i) for i in range(2)}
    feed.set_endpoints(members)
    feed.set_many({name: (address, dict(IDLE)) for name, address in members.items()})
    pickers = [picker_process(POOL, nats_url, stale_after=3.0).wait_ready() for _ in range(2)]
    probe = msgspec.json.encode({"model": REQUESTED, "prompt": "hi"})
    for picker in pickers:
        wait_until(lambda p=picker: route_sync(p.grpc_port, probe).rewrite == REQUESTED,
                   within=20, what="the picker rewrites tweet-summary")
    return pickers


def test_a_picker_killed_mid_stream_leaves_no_answer_naming_the_target(
        tmp_path: Path, nats_server: NatsServer,
        simulated_pods: Callable[..., SimulatedPods],
        picker_process: Callable[..., PickerProcess],
        envoy_gateway: Callable[..., EnvoyProcess]) -> None:
    pods = simulated_pods(2, model=TARGET, time_scale=TIME_SCALE)
    feed = FleetFeed(nats_server.url, POOL, interval=0.1).start()
    try:
        pickers = _two_rewriting_pickers(feed, pods, nats_server.url, picker_process)
        envoy = envoy_gateway([p.endpoint for p in pickers])

        answers = [Answer(path, stream)
                   for path, stream in (("/v1/completions", True),
                                        ("/v1/chat/completions", True),
                                        ("/v1/completions", False))
                   for _ in range(IN_FLIGHT)]
        clients = [threading.Thread(target=_send, args=(envoy.url, a)) for a in answers]
        for client in clients:
            client.start()
        streams = [a for a in answers if a.stream]
        # Every stream has started (its response headers passed the response filters, and its
        # first events reached the client); the JSON answers are still being generated.
        wait_until(lambda: all(any(line.startswith("data: {") for _, line in a.lines)
                               for a in streams), within=30, what="every stream started")
        pickers[0].signal(signal.SIGKILL)
        killed = time.monotonic()
        pickers[0].wait(5)
        for client in clients:
            client.join(60)
        assert not any(client.is_alive() for client in clients)
        assert [a.failure for a in answers] == [""] * len(answers)  # none was cut off

        # The kill landed mid-stream: every stream had events on both sides of it.
        for answer in streams:
            times = [at for at, line in answer.lines if line.startswith("data: {")]
            assert times[0] < killed < times[-1], (answer.path, answer.request_id, killed,
                                                   answer.lines[-3:])
        outcomes = [_judge_stream(a) if a.stream else _judge_json(a) for a in answers]
        # The rewrite no longer depends on any picker after routing: all are restored.
        assert outcomes == ["restored"] * len(answers), outcomes
    finally:
        feed.stop()


def _slow_send(url: str, answer: Answer, release: threading.Event) -> None:
    """As :func:`_send` for a JSON completion whose body arrives in two parts: the second once
    ``release`` is set, so that its ext_proc stream is open on a picker meanwhile."""
    head, tail = msgspec.json.encode({"model": REQUESTED, "max_tokens": 4,
                                      "prompt": "summarize this tweet"}).split(b'"prompt"')

    def body() -> Iterator[bytes]:
        yield head
        release.wait(60)
        yield b'"prompt"' + tail

    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            response = client.post(answer.path, content=body(),
                                   headers={"content-type": "application/json"})
        answer.status, answer.body = response.status_code, response.content
        answer.request_id = response.headers.get("x-request-id", "")
    except httpx.HTTPError as error:
        answer.failure = repr(error)


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_requests_a_picker_held_when_it_failed_are_routed_by_another(
        nats_server: NatsServer, simulated_pods: Callable[..., SimulatedPods],
        picker_process: Callable[..., PickerProcess],
        envoy_gateway: Callable[..., EnvoyProcess], fault: signal.Signals) -> None:
    """A picker that dies (or hangs past Envoy's message timeout) with requests it has not
    routed yet: Envoy routes each again on the other picker (the bootstrap's fallback filter)
    instead of sending it nowhere (503), and the answer still names the requested model."""
    pods = simulated_pods(2, model=TARGET)
    feed = FleetFeed(nats_server.url, POOL, interval=0.1).start()
    pickers: list[PickerProcess] = []
    try:
        pickers = _two_rewriting_pickers(feed, pods, nats_server.url, picker_process)
        envoy = envoy_gateway([p.endpoint for p in pickers])

        release = threading.Event()
        answers = [Answer("/v1/completions", stream=False) for _ in range(IN_FLIGHT)]
        clients = [threading.Thread(target=_slow_send, args=(envoy.url, a, release))
                   for a in answers]
        for client in clients:
            client.start()
        # Every request's stream is open (round robin: half on each picker), its headers
        # answered, its body not yet complete.
        wait_until(lambda: envoy.stats("http.gateway.ext_proc.streams_started").get(
            "http.gateway.ext_proc.streams_started", 0) >= IN_FLIGHT,
            within=20, what="every request's ext_proc stream open")
        pickers[0].signal(fault)
        if fault == signal.SIGKILL:
            pickers[0].wait(5)
        else:
            # Envoy's health check finds a hung picker within 1.5 s, before the 2 s message
            # timeout hands its requests on; a loaded machine can delay the check itself, so the
            # test waits for it rather than race it (what it checks is the hand-over).
            healthy = "cluster.picker.membership_healthy"
            wait_until(lambda: envoy.stats(healthy).get(healthy) == 1, within=20,
                       what="Envoy marking the stopped picker unhealthy")
        release.set()
        for client in clients:
            client.join(60)
        assert not any(client.is_alive() for client in clients)
        assert [(a.status, a.failure) for a in answers] == [(200, "")] * len(answers), (
            answers, envoy.stats("http.gateway.ext_proc"))
        assert [_judge_json(a) for a in answers] == ["restored"] * len(answers)
        fallback = "http.gateway.ext_proc.lig_routing_fallback.streams_started"
        # The requests the failed picker held, and no others, were routed again.
        assert 0 < envoy.stats(fallback).get(fallback, 0) < IN_FLIGHT
    finally:
        if pickers and fault == signal.SIGSTOP:
            pickers[0].signal(signal.SIGCONT)
        feed.stop()


# --- what Envoy's rewrite does with any answer a model server may send ---------------------

ODD = 'llama/3 "chat" \\ caf\u00e9'  # a requested name that JSON must escape
SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
GATE = b""  # in a script: wait until the client has read an event, then go on


def _event(model: str, text: str) -> bytes:
    return b"data: " + msgspec.json.encode({"id": "x", "object": "text_completion",
                                            "model": model, "choices": [{"text": text}]})


def _json_head(body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"%sconnection: close\r\n\r\n" % (len(body), extra))


def _pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


class ScriptedServer:
    """A real HTTP/1.1 model server on loopback that answers each request with the script its
    ``prompt`` names: a head, then body parts sent one by one (chunked when the head says so);
    a :data:`GATE` part waits until :attr:`gate` is set (by the client, once it has read an
    event: proof that events pass before the stream ends)."""

    def __init__(self, scripts: dict[str, tuple[bytes, list[bytes]]]) -> None:
        self.scripts = scripts
        self.gate = threading.Event()
        self.gate_timed_out = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection: socket.socket) -> None:
        with connection:
            data = b""
            while b"\r\n\r\n" not in data:
                data += connection.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            while len(body) < length:
                body += connection.recv(65536)
            start, parts = self.scripts[msgspec.json.decode(body)["prompt"]]
            connection.sendall(start)
            chunked = b"transfer-encoding: chunked" in start
            for part in parts:
                if part is GATE:
                    self.gate_timed_out |= not self.gate.wait(30)
                    continue
                connection.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
            if chunked:
                connection.sendall(b"0\r\n\r\n")

    def close(self) -> None:
        self._listener.close()


def _scripts() -> dict[str, tuple[bytes, list[bytes]]]:
    first, rest = _event(TARGET, "one") + b"\n\n", (
        _event(TARGET, "two") + b"\n\n" + _event(TARGET, "three") + b"\n\ndata: [DONE]\n\n")
    spaced = b'{"id": "x", "model" : "tweet-summary-1", "usage": {"completion_tokens": 3}}'
    escaped = b'{"id":"x","model":"tweet-summary-1\\u0021","choices":[]}'
    compressed = gzip.compress(msgspec.json.encode({"model": TARGET}))
    return {
        # Every key, value and line split across chunks of 7 bytes; the rest waits until the
        # client has read the first event.
        "split": (SSE_HEAD, [*_pieces(first, 7), GATE, *_pieces(rest, 7)]),
        "no final newline": (SSE_HEAD, [_event(TARGET, "one") + b"\n\n" + _event(TARGET, "end")]),
        "escaped event": (SSE_HEAD, [first, _event(TARGET, "two").replace(
            b'"tweet-summary-1"', b'"tweet-summary-1\\u0021"') + b"\n\n", rest]),
        "spaced json": (_json_head(spaced), [spaced]),
        "escaped json": (_json_head(escaped), [escaped]),
        "gzip json": (_json_head(compressed, b"content-encoding: gzip\r\n"), [compressed]),
    }


class RewriteStack(msgspec.Struct):
    """Envoy in front of one real picker that sends both requested names to the scripted
    server's target model."""

    envoy: EnvoyProcess
    server: ScriptedServer


@pytest.fixture(scope="module")
def rewrite_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RewriteStack]:
    workdir = tmp_path_factory.mktemp("rewrite")
    server = ScriptedServer(_scripts())
    nats = NatsServer(workdir / "jetstream")
    feed: FleetFeed | None = None
    picker: PickerProcess | None = None
    envoy: EnvoyProcess | None = None
    try:
        nats.start()
        feed = FleetFeed(nats.url, POOL, interval=0.1).start()
        feed.set_pool()
        for name in (REQUESTED, ODD):
            feed.set_model(name, target_models=[{"name": TARGET, "weight": 1}])
        feed.set_endpoints({"pod-0": server.address})
        feed.set_many({"pod-0": (server.address, dict(IDLE))})
        picker = PickerProcess(POOL, nats.url, workdir, stale_after=3.0).start().wait_ready()
        port = picker.grpc_port
        for name in (REQUESTED, ODD):
            probe = msgspec.json.encode({"model": name, "prompt": "hi"})
            wait_until(lambda probe=probe: route_sync(port, probe).rewrite is not None,
                       within=20, what=f"the picker rewrites {name}")
        envoy = start_envoy([picker.endpoint], workdir)
        yield RewriteStack(envoy, server)
    finally:
        if envoy is not None:
            envoy.stop()
        if picker is not None:
            picker.stop()
        if feed is not None:
            feed.stop()
        nats.stop()
        server.close()


def _events(url: str, prompt: str, gate: threading.Event | None = None,
            http2: bool = False, model: str = REQUESTED) -> list[Any]:
    """The decoded ``data:`` events of a streamed answer; ``gate`` is set after the first."""
    documents: list[Any] = []
    with httpx.Client(base_url=url, timeout=60, http1=not http2, http2=http2) as client, \
            client.stream("POST", "/v1/completions",
                          json={"model": model, "prompt": prompt, "stream": True}) as response:
        assert response.status_code == 200
        assert "content-length" not in response.headers
        for line in response.iter_lines():
            if line.startswith("data: "):
                documents.append(msgspec.json.decode(line[6:]) if line != "data: [DONE]"
                                 else "[DONE]")
                if gate is not None:
                    gate.set()
    return documents


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "http2"])
def test_events_split_anywhere_are_restored_as_they_pass(
        rewrite_stack: RewriteStack, http2: bool) -> None:
    url, server = rewrite_stack.envoy.url, rewrite_stack.server
    server.gate.clear()
    documents = _events(url, "split", gate=server.gate, http2=http2)
    # The server sent the rest only after the client had read the first event: nothing waits
    # for the end of the stream.
    assert not server.gate_timed_out
    assert [d["model"] for d in documents[:-1]] == [REQUESTED] * 3
    assert [d["choices"][0]["text"] for d in documents[:-1]] == ["one", "two", "three"]
    assert documents[-1] == "[DONE]"


def test_a_stream_without_a_final_newline_keeps_its_last_event(
        rewrite_stack: RewriteStack) -> None:
    documents = _events(rewrite_stack.envoy.url, "no final newline")
    assert [(d["model"], d["choices"][0]["text"]) for d in documents] == [
        (REQUESTED, "one"), (REQUESTED, "end")]


def test_a_name_json_must_escape_is_put_back_exactly(rewrite_stack: RewriteStack) -> None:
    documents = _events(rewrite_stack.envoy.url, "split", model=ODD)
    assert [d["model"] for d in documents[:-1]] == [ODD] * 3
    answer = httpx.post(rewrite_stack.envoy.url + "/v1/completions",
                        json={"model": ODD, "prompt": "spaced json"}, timeout=30)
    assert answer.status_code == 200 and answer.json()["model"] == ODD


def test_json_is_restored_whatever_its_spacing_with_its_length(
        rewrite_stack: RewriteStack) -> None:
    answer = httpx.post(rewrite_stack.envoy.url + "/v1/completions",
                        json={"model": REQUESTED, "prompt": "spaced json"}, timeout=30)
    assert answer.status_code == 200
    assert answer.json() == {"id": "x", "model": REQUESTED, "usage": {"completion_tokens": 3}}
    assert int(answer.headers["content-length"]) == len(answer.content)


@pytest.mark.parametrize("prompt", ["escaped json", "gzip json"])
def test_json_that_cannot_be_restored_is_an_openai_error(
        rewrite_stack: RewriteStack, prompt: str) -> None:
    answer = httpx.post(rewrite_stack.envoy.url + "/v1/completions",
                        json={"model": REQUESTED, "prompt": prompt}, timeout=30)
    assert answer.status_code == 500
    assert answer.headers["content-type"] == "application/json"
    assert "content-encoding" not in answer.headers
    assert answer.json()["error"]["code"] == "model_name_not_restored"
    assert _openai_error(answer.json())


def test_a_stream_that_cannot_be_restored_ends_in_an_error_event(
        rewrite_stack: RewriteStack) -> None:
    documents = _events(rewrite_stack.envoy.url, "escaped event")
    assert documents[0]["model"] == REQUESTED
    assert _openai_error(documents[1])
    assert documents[1]["error"]["code"] == "model_name_not_restored"
    assert len(documents) == 2  # nothing after the error, not even [DONE]
