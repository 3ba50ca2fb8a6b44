"""Envoy's external processing API: one ``Process`` stream per HTTP request.

The request headers are answered at once (CONTINUE, route cache cleared, any client-supplied
destination header removed), except when Envoy streams the body without waiting: then the
headers answer is held until the body is complete, because it must carry the destination. The
complete body is routed (see :mod:`services.picker.routing`); the answer sets the destination
header, the ``envoy.lb`` dynamic metadata, and the rewritten body with its ``content-length``.
Errors become an ImmediateResponse with an OpenAI-shaped JSON body; the stream stays healthy.

When a request was resolved to a different target model, the routing answer also sets
``x-gateway-model-rewrite`` (the requested name, percent-encoded) and the requested name in the
``lig`` dynamic metadata. The shipped Envoy bootstrap puts that name back in the response itself
(its ``lig.response_rewrite`` Lua filter), so that no picker is needed once a request is routed:
a picker that dies while a response streams leaves no answer naming the target (issue 26), and
every request costs the picker two messages. In FULL_DUPLEX_STREAMED mode the response passes
the routing stream anyway, and the picker puts the name back there too, for gateways without
that filter. Bootstraps before issue 26 ran a second ext_proc filter for such requests, whose
stream starts with the response headers (carrying the metadata) or with request headers
carrying ``x-gateway-model-rewrite``; the picker still answers it, with a ``mode_override``
asking for the response body (BUFFERED for JSON, STREAMED for Server-Sent Events), and rewrites
``model`` back to the name the client asked for.

Envoy 1.34 and later say how they send bodies (``protocol_config`` on the first message). A
client that does not (older Envoy, other ext_proc clients) is taken to wait for each answer, as
Envoy does by default: the headers are answered at once, a body that arrives whole in one message
(end of stream set: BUFFERED) is answered at once, and a body whose first chunk does not end the
stream is held, whole, up to :data:`MAX_HELD_BODY`, and answered at its end (or at the trailers)
with one answer per chunk, the destination on the first (STREAMED). A stream is decided once: a
body message after the body's end (Envoy issue #46237) is not routed again, and after an
ImmediateResponse nothing more of that request is answered.

Behind a Gateway API gateway the same stream speaks the endpoint picker protocol
(:mod:`services.picker.epp`): the subset hint limits the pick, the destination names fallbacks,
the served endpoint reported with the response moves the request's accounting, and in
FULL_DUPLEX_STREAMED mode the held headers answer is followed by the body sent back in
streamed chunks (then the trailers), and every response chunk comes back the same way. With
``--conformance-test-headers`` it also honours the conformance suite's test headers
(:mod:`services.picker.conformance`).

The pure per-stream logic, testable with protobuf objects and no network:

- :class:`Exchange` picks the stream's role at its first message and hands it every message:
  :class:`ResponseExchange` for the rewrite stream of a bootstrap before issue 26 (it routes
  nothing), :class:`RoutingExchange` for any other stream.
- :class:`RoutingExchange` routes the request and follows its response (outcome, served
  endpoint, usage). How the request body arrives is a :class:`BodyMode`, one small stateless
  strategy per mode Envoy tells (:class:`BufferedBody`, :class:`NoBody`, :class:`StreamedBody`,
  :class:`FullDuplexBody`) and :class:`UntoldBody` when it tells none; each answers a body
  message and the trailers by calling back the exchange (hold a chunk, route the held body).
- :class:`ResponsePass` is the response as it passes either role: its headers' answer, the
  rewriter putting the requested name back and reading usage, the chunks' answers.
- Both roles talk to one object, the :class:`Processor`: what every stream shares (the gateway,
  metrics, prebuilt answers), behind narrow methods (route, destination, served endpoint,
  outcome sampling, finished).

:class:`ProcessStream` runs an :class:`Exchange` on the built-in HTTP/2 server
(:mod:`protocols.http2`), and :class:`ExternalProcessor` is the grpc.aio servicer around it.
"""

from __future__ import annotations

import abc
import logging
import time
import traceback
import urllib.parse
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import msgspec
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.type.v3 import http_status_pb2

from services.picker import conformance, epp
from services.picker.observability import PickerMetrics
from services.picker.pools import Gateway, ResponseSeen
from services.picker.responses import ResponseRewriter, Usage
from services.picker.routing import Rejected, Routed, reject
from shared.logs import RateLimitedLog

log = logging.getLogger("lig.picker.ext_proc")

Mode = processing_mode_pb2.ProcessingMode
NONE, STREAMED, BUFFERED = Mode.NONE, Mode.STREAMED, Mode.BUFFERED
DUPLEX = Mode.FULL_DUPLEX_STREAMED
# Body bytes per streamed body answer in FULL_DUPLEX_STREAMED mode (the reference EPP's size).
DUPLEX_CHUNK = 62_000
# A body Envoy streams (FULL_DUPLEX_STREAMED, STREAMED, or chunks from a gateway that did not say)
# is not buffered by Envoy, so its 32 MiB limit (413 request_too_large in the shipped bootstrap)
# does not apply: the picker holds at most as much.
MAX_HELD_BODY = 32 * 1024 * 1024
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_EVENT_STREAM = b"text/event-stream"
REWRITE_HEADER = "x-gateway-model-rewrite"
# Dynamic metadata namespace and key naming the requested model for Envoy's response-rewrite
# filter (and for the ext_proc rewrite streams of bootstraps before issue 26, which start with
# the response headers).
METADATA_NAMESPACE = "lig"
REQUESTED_MODEL_KEY = "requested_model"
# The answers to one message, in order.
Replies = tuple[pb.ProcessingResponse, ...]


def _set_header(mutation: pb.HeaderMutation, key: str, value: bytes) -> None:
    # Envoy reads raw_value (bytes); it leaves `value` empty in what it sends, too.
    option = mutation.set_headers.add()
    option.header.key = key
    option.header.raw_value = value
    option.append_action = _OVERWRITE


class Processor:
    """What every stream shares: the gateway (pools, routers, pod tables), metrics and prebuilt
    answers. The exchanges talk to it alone, through its methods, never to the gateway.

    ``record_responses``: ask Envoy for every routed request's response headers and body, so
    that the outcome records carry status, time to first byte and usage
    (``--record-responses``); the gateway must be recording. ``conformance``: honour the
    conformance suite's test headers (``--conformance-test-headers``,
    :mod:`services.picker.conformance`).
    """

    def __init__(self, gateway: Gateway, metrics: PickerMetrics, destination_header: str,
                 clock: Callable[[], float] = time.perf_counter,
                 record_responses: bool = False, conformance: bool = False) -> None:
        self.gateway = gateway
        self.recording = gateway.on_record is not None
        self.record_responses = record_responses and self.recording
        self.conformance = conformance
        self.metrics = metrics
        self.header = destination_header.lower()
        self._clock = clock
        self._errors = RateLimitedLog(log)
        self._repeated_ends = RateLimitedLog(log)
        self.headers_continue = pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                clear_route_cache=True,
                header_mutation=pb.HeaderMutation(remove_headers=[self.header, REWRITE_HEADER]))))
        self.rewrite_headers_continue = pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                header_mutation=pb.HeaderMutation(remove_headers=[REWRITE_HEADER]))))
        self.request_body_continue = pb.ProcessingResponse(request_body=pb.BodyResponse())
        self.response_headers_continue = pb.ProcessingResponse(
            response_headers=pb.HeadersResponse())
        self.response_body_continue = pb.ProcessingResponse(response_body=pb.BodyResponse())
        self.request_trailers_continue = pb.ProcessingResponse(
            request_trailers=pb.TrailersResponse())
        self.response_trailers_continue = pb.ProcessingResponse(
            response_trailers=pb.TrailersResponse())
        self._headers_overridden: dict[tuple[int, bool], pb.ProcessingResponse] = {}

    def headers_continue_buffered(self, response_body_mode: int,
                                  report_status: bool = False) -> pb.ProcessingResponse:
        """CONTINUE that also switches the request body to BUFFERED (both body modes restated,
        since Envoy copies both from an override) and, with ``report_status``, asks for the
        response headers on this stream (the gray-pod guard's outcome sample)."""
        key = (response_body_mode, report_status)
        reply = self._headers_overridden.get(key)
        if reply is None:
            reply = pb.ProcessingResponse()
            reply.CopyFrom(self.headers_continue)
            reply.mode_override.request_body_mode = BUFFERED
            reply.mode_override.response_body_mode = response_body_mode
            if report_status:
                reply.mode_override.response_header_mode = Mode.SEND
            self._headers_overridden[key] = reply
        return reply

    def route(self, body: bytes | None, subset: frozenset[str] | None = None,
              objective: str | None = None, method: str = "GET",
              path: str = "/", request_id: str = "",
              selection: conformance.Selection | None = None) -> Routed | Rejected:
        """Route one request, counting the outcome. ``None``: it has no body; then ``method``
        and ``path`` say what it asks. ``subset``, ``objective`` and ``request_id`` as
        :meth:`Router.route` takes them; ``selection`` as :meth:`Gateway.route`."""
        start = self._clock()
        result = (self.gateway.route(body, subset, objective, request_id, selection)
                  if body is not None
                  else self.gateway.route_bodiless(method, path, subset, selection))
        self.metrics.decision_seconds.observe(self._clock() - start)
        if isinstance(result, Routed):
            self.gateway.started(result)
            self.metrics.count_request(result.model, result.target_model, result.registered,
                                       result.pod, "routed")
        else:
            self.metrics.count_request(result.model, result.target_model, result.registered,
                                       "", result.outcome)
        return result

    def set_destination(self, reply: pb.ProcessingResponse, common: pb.CommonResponse,
                        routed: Routed) -> None:
        """Destination header, ``envoy.lb`` metadata (both ``primary,fallback,...``), and the
        new body's content-length."""
        mutation = common.header_mutation
        destination = (",".join((routed.endpoint, *routed.fallbacks)) if routed.fallbacks
                       else routed.endpoint)
        _set_header(mutation, self.header, destination.encode())
        if routed.body is not None:
            _set_header(mutation, "content-length", str(len(routed.body)).encode())
            _set_header(mutation, REWRITE_HEADER,
                        urllib.parse.quote(routed.model, safe="").encode())
            reply.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields[
                REQUESTED_MODEL_KEY].string_value = routed.model
        else:  # a client-supplied value must not switch the response rewrite on
            mutation.remove_headers.append(REWRITE_HEADER)
        common.clear_route_cache = True
        lb = reply.dynamic_metadata.fields[epp.LB_NAMESPACE].struct_value
        lb.fields[self.header].string_value = destination

    def served(self, routed: Routed, served: str) -> Routed:
        """The gateway reports that ``served`` (``ip:port``) answered the request routed as
        ``routed``: when that is another member (a fallback), the request is accounted to it
        from now on; the decision to account for is returned."""
        if served == routed.endpoint:
            return routed
        pods = self.gateway.table(routed.pool)
        member = pods.member_at(served) if pods is not None else None
        if pods is None or member is None:
            self._errors.warning("the gateway reports endpoint %s served a request, but it is no "
                                 "member of the pool; it stays accounted to %s", served,
                                 routed.pod)
            return routed
        self.gateway.served_elsewhere(routed, member.name)
        self.metrics.count_served_elsewhere()
        return msgspec.structs.replace(routed, pod=member.name, endpoint=served)

    def wants_outcome(self) -> bool:
        """Whether the request about to be routed should send its response headers to its
        stream: the gray-pod guard's outcome sample (asked of every pool, so that each one's
        sampling sees every request), or ``--record-responses``."""
        return self.gateway.wants_outcome() or self.record_responses

    def responded(self, routed: Routed, status: int) -> None:
        """The response to the request routed as ``routed`` started with ``status``."""
        self.gateway.responded(routed, status)

    def finished(self, routed: Routed, usage: Usage | None = None,
                 seen: ResponseSeen | None = None) -> None:
        """The request routed as ``routed`` is no longer in flight (its stream ended, or a
        newer request replaced it on the stream), with the token ``usage`` its response
        reported and what passed of the response (``seen``), when known; the tokens are
        counted."""
        if usage is None:
            self.gateway.finished(routed, response=seen)
            return
        self.gateway.finished(routed, usage.prompt_tokens, usage.completion_tokens, seen,
                              usage.cached_tokens)
        if usage.cached_tokens is not None:
            self.metrics.count_reuse(routed.pool, routed.cached_on(routed.pod),
                                     usage.cached_tokens)
        self.metrics.count_tokens(routed.model, routed.registered, usage)

    def immediate(self, rejected: Rejected) -> pb.ProcessingResponse:
        """The ImmediateResponse answering the client with ``rejected``'s status and body."""
        reply = pb.ProcessingResponse()
        answer = reply.immediate_response
        answer.status.code = rejected.status
        answer.body = rejected.body
        answer.details = f"lig_picker_{rejected.outcome}"
        _set_header(answer.headers, "content-type", b"application/json")
        if rejected.status == http_status_pb2.TooManyRequests:
            _set_header(answer.headers, "retry-after", b"1")
        return reply

    def too_large(self) -> Rejected:
        """The 413 for a streamed request body beyond :data:`MAX_HELD_BODY` (counted)."""
        rejected = reject(413, "the request body is larger than the gateway accepts (32 MiB)",
                          "request_too_large")
        self.metrics.count_request("", "", False, "", rejected.outcome)
        return rejected

    def repeated_end(self) -> None:
        """A request body message after the body ended: logged (rate limited), never routed."""
        self._repeated_ends.warning(
            "Envoy sent a request body message after the body's end of stream (Envoy issue "
            "#46237: FULL_DUPLEX_STREAMED repeats the last chunk of bodies of 1 MB or more); "
            "ignored: the request was routed once, on the first")

    def internal_error(self, exc: BaseException) -> pb.ProcessingResponse:
        """A 500 for a bug in the picker: logged (rate limited), counted, stream kept."""
        self._errors.warning("error handling an ext_proc message: %s",
                             "".join(traceback.format_exception(exc)))
        self.metrics.count_request("", "", False, "", "500")
        return self.immediate(reject(500, "the endpoint picker failed", "picker_error"))


class Exchange:
    """One HTTP request's ext_proc conversation: what came in, and the answers to send.

    It picks the stream's role at the first message and hands every message to it: a
    :class:`ResponseExchange` for the response-rewrite stream of a bootstrap before issue 26
    (its first message is the response headers, or request headers naming the model to put
    back), a :class:`RoutingExchange` for any other stream."""

    __slots__ = ("_p", "_role")

    def __init__(self, processor: Processor) -> None:
        self._p = processor
        self._role: RoutingExchange | ResponseExchange | None = None

    @property
    def routed(self) -> Routed | None:
        """The request's current decision (None until routed; always on a rewrite stream)."""
        return self._role.routed if self._role is not None else None

    def handle(self, message: pb.ProcessingRequest) -> Replies:
        """The answers to ``message`` (none while its answer must wait for more body)."""
        role = self._role
        if role is None:
            role = self._role = _role_for(self._p, message)
        return role.handle(message)

    def close(self) -> None:
        """The stream ended (see :meth:`RoutingExchange.close`)."""
        if self._role is not None:
            self._role.close()


def _role_for(processor: Processor, first: pb.ProcessingRequest
              ) -> RoutingExchange | ResponseExchange:
    """The role of the stream whose first message is ``first``."""
    if first.HasField("request_headers"):
        # A stream told that no request body comes, for a request naming the model to put
        # back: an earlier bootstrap's rewrite filter, for a request the picker rewrote.
        # (The mode first: NONE is also what a message without protocol_config reads.)
        if first.protocol_config.request_body_mode == NONE and first.HasField("protocol_config"):
            requested = _header(first.request_headers, REWRITE_HEADER)
            if requested is not None:
                return ResponseExchange(processor, first.protocol_config,
                                        urllib.parse.unquote(requested.decode(errors="replace")))
    elif first.HasField("response_headers") and first.HasField("protocol_config"):
        # The rewrite filter of an earlier bootstrap placed after the router: its stream
        # starts at the response, the name to put back in the routing answer's metadata.
        fields = first.metadata_context.filter_metadata.get(METADATA_NAMESPACE)
        name = fields.fields.get(REQUESTED_MODEL_KEY) if fields is not None else None
        requested = name.string_value if name is not None and name.string_value else None
        return ResponseExchange(processor, first.protocol_config, requested)
    return RoutingExchange(processor)


class ResponseExchange:
    """The response-rewrite stream of a bootstrap before issue 26: it routes nothing, and puts
    the requested name back in the response (``requested``; None: the response passes
    unchanged). Request messages, which such a filter does not send after the first, get the
    answer that changes nothing."""

    __slots__ = ("_p", "_requested", "_response")
    routed: Routed | None = None  # nothing is routed on this stream

    def __init__(self, processor: Processor, config: pb.ProtocolConfiguration,
                 requested: str | None) -> None:
        self._p = processor
        self._requested = requested
        self._response = ResponsePass(processor, config.request_body_mode,
                                      config.response_body_mode)

    def handle(self, message: pb.ProcessingRequest) -> Replies:
        """The answers to ``message``."""
        kind = message.WhichOneof("request")
        if kind == "response_headers":
            return self._response.headers(message.response_headers, self._requested)
        if kind == "response_body":
            return self._response.body(message.response_body)
        if kind == "response_trailers":
            return self._response.trailers()
        if kind == "request_headers":
            return (self._p.rewrite_headers_continue,)
        if kind == "request_body":
            return (self._p.request_body_continue,)
        if kind == "request_trailers":
            return (self._p.request_trailers_continue,)
        return ()

    def close(self) -> None:
        """Nothing to account for: the routing stream of the request did (and counted its
        tokens, when it read them)."""


class RoutingExchange:
    """The routing stream: the request's headers and body in, the destination out (or an
    ImmediateResponse); then, when Envoy sends them here, the response's headers and body
    (outcome, served endpoint, usage, the requested name put back).

    How the request body arrives is its :class:`BodyMode`, chosen from ``protocol_config``;
    the body modes call back :meth:`hold`, :meth:`take_held`, :meth:`answer_body` and
    :meth:`answer_duplex`. The response passes through a :class:`ResponsePass`."""

    __slots__ = ("_body_ended", "_body_mode", "_chunks", "_held_bytes", "_objective", "_p",
                 "_refused", "_reports_status", "_request_id", "_request_mode", "_response",
                 "_response_mode", "_rewrite_to", "_seen", "_selection", "_served_seen",
                 "_subset", "routed")

    def __init__(self, processor: Processor) -> None:
        self._p = processor
        self.routed: Routed | None = None
        # Envoy 1.34 and later tell the body modes on the first message; until told, the
        # chunks say how the body comes.
        self._body_mode: BodyMode = _UNTOLD_BODY
        self._request_mode = BUFFERED
        self._response_mode = NONE
        # Made at the first response message: a routing stream often sees none.
        self._response: ResponsePass | None = None
        # The request body as it arrives, while its answers wait for its end.
        self._chunks: list[bytes] = []
        self._held_bytes = 0
        self._body_ended = False  # the request body's end was answered (routed or refused)
        self._refused = False  # an ImmediateResponse ended the request: nothing more is answered
        self._rewrite_to: str | None = None  # the requested name, when the response needs it
        self._reports_status = False  # Envoy sends this stream the response headers for it
        self._subset: frozenset[str] | None = None  # the gateway's subset hint
        self._objective: str | None = None  # the InferenceObjective the request names
        self._selection: conformance.Selection | None = None  # --conformance-test-headers
        self._served_seen = False
        self._request_id = ""  # Envoy's x-request-id, when recording
        self._seen: ResponseSeen | None = None  # what passed of the response, when recording

    def handle(self, message: pb.ProcessingRequest) -> Replies:
        """The answers to ``message`` (none while its answer must wait for more body)."""
        kind = message.WhichOneof("request")
        if kind == "request_body":
            return self._request_body(message.request_body)
        if kind == "request_headers":
            return self._request_headers(message)
        if not self._served_seen and self.routed is not None and message.HasField(
                "metadata_context"):
            self._take_served(message.metadata_context)
        if kind == "response_headers":
            replies = self._response_headers(message.response_headers)
            if self._p.conformance and self.routed is not None:
                return _with_served_header(replies, message.metadata_context)
            return replies
        if kind == "response_body":
            return self._response_body(message.response_body)
        if kind == "request_trailers":
            return self._request_trailers()
        if kind == "response_trailers":
            return self._response_pass().trailers()
        return ()

    def close(self) -> None:
        """The stream ended: the request is no longer in flight; count its token usage (read
        when this stream saw the response body: ``--record-responses``, FULL_DUPLEX_STREAMED)."""
        if self.routed is not None:
            usage = self._response.usage if self._response is not None else None
            self._p.finished(self.routed, usage, self._seen)

    def _take_served(self, metadata: base_pb2.Metadata) -> None:
        served = epp.served_endpoint(metadata)
        if served is not None and self.routed is not None:
            self._served_seen = True
            self.routed = self._p.served(self.routed, served)

    # --- request -------------------------------------------------------------------------

    def _request_headers(self, message: pb.ProcessingRequest) -> Replies:
        # A new request (Envoy sends one per stream; a peer may send more): its body starts.
        if self._chunks:
            self._chunks = []
        self._held_bytes = 0
        self._body_ended = self._refused = False
        if message.HasField("protocol_config"):
            config = message.protocol_config
            self._request_mode = config.request_body_mode
            self._response_mode = config.response_body_mode
            self._body_mode = _body_mode(self._request_mode, config)
            if self._response is not None:  # a later request on the stream (a peer's)
                self._response.request_mode = self._request_mode
                self._response.mode = self._response_mode
        if message.HasField("metadata_context"):
            self._subset = epp.subset_hint(message.metadata_context)
        headers = message.request_headers
        if self._p.conformance:
            self._selection = conformance.selection(headers)
        if headers.end_of_stream or self._body_mode.routes_on_headers:
            self._body_ended = True
            return (self._answer_headers_with(self._p.route(
                None, self._subset, method=_text(_header(headers, ":method")),
                path=_text(_header(headers, ":path")), selection=self._selection)),)
        # Only a request with a body is scheduled, so only it needs the objective header.
        self._objective = epp.objective(headers)
        if self._p.recording:
            self._request_id = epp.request_id(headers)
        if self._body_mode.holds_headers:
            return ()
        self._reports_status = self._p.wants_outcome()
        # The conformance suite's served-endpoint header goes on the response headers' answer.
        response_headers = self._reports_status or self._p.conformance
        if self._body_mode.asks_buffered or response_headers:
            return (self._p.headers_continue_buffered(self._response_mode, response_headers),)
        return (self._p.headers_continue,)

    def _request_body(self, body: pb.HttpBody) -> Replies:
        if self._refused:
            return ()
        if self._body_ended:
            # Envoy issue #46237 repeats the last chunk, with end of stream, of
            # FULL_DUPLEX_STREAMED bodies of 1 MB or more: the request was routed on the
            # first end, and is not routed again. Where Envoy expects an answer per message,
            # it gets the empty one, which changes nothing; in FULL_DUPLEX_STREAMED the body
            # went back with its end of stream, and any further body answer would be spurious.
            self._p.repeated_end()
            return (self._p.request_body_continue,) if self._body_mode.answers_each_message \
                else ()
        return self._body_mode.body(self, body)

    def _request_trailers(self) -> Replies:
        """The trailers end a body whose last chunk did not: a held body is answered first."""
        if self._refused:
            return ()
        if self._body_ended:
            return (self._p.request_trailers_continue,)
        replies = self._body_mode.trailers(self)
        if replies and replies[0].HasField("immediate_response"):  # the request ends there
            return replies
        return (*replies, self._p.request_trailers_continue)

    @property
    def held_chunks(self) -> int:
        """How many chunks of the body are held."""
        return len(self._chunks)

    def hold(self, chunk: bytes) -> Replies | None:
        """Keep ``chunk`` until the body is complete; the 413 once the body is beyond
        :data:`MAX_HELD_BODY` (Envoy's own limit does not apply to a body it streams)."""
        self._held_bytes += len(chunk)
        if self._held_bytes > MAX_HELD_BODY:
            return (self._refuse(self._p.too_large()),)
        self._chunks.append(chunk)
        return None

    def take_held(self) -> tuple[bytes, int]:
        """The held body, whole, and the number of chunks it came in; nothing is held after."""
        chunks = self._chunks
        self._chunks = []
        return (chunks[0] if len(chunks) == 1 else b"".join(chunks)), len(chunks)

    def answer_body(self, body: bytes, chunks: int, headers_held: bool) -> Replies:
        """Route the complete body that came in ``chunks`` messages: the held headers answer
        first (``headers_held``), then one answer per message, in order (an ImmediateResponse
        ends the request instead)."""
        self._body_ended = True
        result = self._p.route(body, self._subset, self._objective,
                              request_id=self._request_id, selection=self._selection)
        if isinstance(result, Rejected):
            return (self._refuse(result),)
        self._take(result)
        replies: list[pb.ProcessingResponse] = []
        if headers_held:
            replies.append(self._headers_answer(result))
        # The destination rides on the first answer Envoy reads before it forwards the
        # headers; a rewritten body replaces the last chunk and the earlier ones are cleared.
        for index in range(chunks):
            carries_destination = index == 0 and not headers_held
            if result.body is None and not carries_destination:
                replies.append(self._p.request_body_continue)
                continue
            reply = pb.ProcessingResponse()
            common = reply.request_body.response
            common.SetInParent()
            if carries_destination:
                self._p.set_destination(reply, common, result)
            if result.body is not None:
                if index == chunks - 1:
                    common.body_mutation.body = result.body
                else:
                    common.body_mutation.clear_body = True
            replies.append(reply)
        return tuple(replies)

    def answer_duplex(self, end_of_stream: bool) -> Replies:
        """FULL_DUPLEX_STREAMED: the whole body is held (its last chunk came, with
        ``end_of_stream``, or the trailers after it). Answer in the order Envoy requires: the
        headers (with the destination), then the body sent back as streamed chunks (rewritten
        when the model was); the trailers' answer follows, when they ended it."""
        self._body_ended = True
        whole, _ = self.take_held()
        result = self._p.route(whole, self._subset, self._objective,
                              request_id=self._request_id, selection=self._selection)
        if isinstance(result, Rejected):
            return (self._refuse(result),)
        headers = self._answer_headers_with(result)
        self._reports_status = self._p.wants_outcome()
        return (headers, *_streamed_bodies(result.body if result.body is not None else whole,
                                           end_of_stream, request=True))

    def _answer_headers_with(self, result: Routed | Rejected) -> pb.ProcessingResponse:
        if isinstance(result, Rejected):
            return self._refuse(result)
        self._take(result)
        return self._headers_answer(result)

    def _headers_answer(self, routed: Routed) -> pb.ProcessingResponse:
        reply = pb.ProcessingResponse()
        self._p.set_destination(reply, reply.request_headers.response, routed)
        return reply

    def _take(self, routed: Routed) -> None:
        # Envoy routes one request per stream, but a peer may route a second on the same
        # stream (headers or a body again): the request it replaces is no longer in flight,
        # and only the newest decision may ask for the response rewrite.
        if self.routed is not None:
            self._p.finished(self.routed)
        self.routed = routed
        self._rewrite_to = routed.model if routed.body is not None else None

    def _refuse(self, rejected: Rejected) -> pb.ProcessingResponse:
        """The ImmediateResponse ending this request: Envoy stops processing it, so whatever
        else of it arrives (chunks already on their way) is not answered again."""
        self._chunks = []
        self._refused = True
        return self._p.immediate(rejected)

    # --- response ------------------------------------------------------------------------

    def _response_pass(self) -> ResponsePass:
        response = self._response
        if response is None:
            response = self._response = ResponsePass(self._p, self._request_mode,
                                                     self._response_mode)
        return response

    def _response_headers(self, headers: pb.HttpHeaders) -> Replies:
        routed = self.routed
        if self._p.recording and routed is not None:
            self._seen = ResponseSeen(_status(headers))
        response = self._response_pass()
        if response.mode == DUPLEX:  # the response passes here whatever was asked
            if self._reports_status and routed is not None:
                self._reports_status = False
                self._p.responded(routed, _status(headers))
            return response.headers(headers, self._rewrite_to)
        if not self._reports_status:
            return response.headers(headers, self._rewrite_to)
        # Asked for its status (the gray-pod guard's sample, --record-responses): Envoy's
        # response-rewrite filter puts the name back, so only --record-responses reads on.
        self._reports_status = False
        if routed is None:
            return (self._p.response_headers_continue,)
        self._p.responded(routed, _status(headers))
        if self._p.record_responses and not headers.end_of_stream:
            reply = response.read(headers)
            self._response_mode = response.mode  # what it asked for, for a later request
            return (reply,)
        return (self._p.response_headers_continue,)

    def _response_body(self, body: pb.HttpBody) -> Replies:
        seen = self._seen
        if seen is not None and not seen.first_byte_ns and body.body:
            seen.first_byte_ns = time.perf_counter_ns()
        return self._response_pass().body(body)


class BodyMode(abc.ABC):
    """How a request body arrives and is answered, by the body mode Envoy sends it in: one
    shared, stateless instance per mode, acting on the :class:`RoutingExchange` (which holds
    the chunks).

    ``holds_headers``: the headers answer waits for the body's end, as Envoy sends the body
    without waiting for it and it must carry the destination. ``asks_buffered``: the headers
    answer asks Envoy to buffer the body (``mode_override``). ``answers_each_message``: Envoy
    expects an answer per body message. ``routes_on_headers``: no body comes (NONE), so the
    request is routed on its headers."""

    holds_headers = False
    asks_buffered = False
    answers_each_message = True
    routes_on_headers = False

    @abc.abstractmethod
    def body(self, exchange: RoutingExchange, body: pb.HttpBody) -> Replies:
        """The answers to one body message (none while they wait for the body's end)."""

    @abc.abstractmethod
    def trailers(self, exchange: RoutingExchange) -> Replies:
        """The answers the body gets when the trailers end it (before the trailers' own)."""


class BufferedBody(BodyMode):
    """BUFFERED (and BUFFERED_PARTIAL): the body comes whole, in one message, routed and
    answered at once; told BUFFERED, also without end of stream (trailers follow it)."""

    def body(self, exchange: RoutingExchange, body: pb.HttpBody) -> Replies:
        """Route the body and answer its one message."""
        return exchange.answer_body(body.body, 1, headers_held=False)

    def trailers(self, exchange: RoutingExchange) -> Replies:
        """Nothing: a buffered body was answered when it came."""
        return ()


class NoBody(BufferedBody):
    """NONE: Envoy sends no body; the request is routed on its headers."""

    routes_on_headers = True


class StreamedBody(BodyMode):
    """STREAMED: chunks as they arrive, each expecting an answer; the chunks are held, whole,
    up to :data:`MAX_HELD_BODY`, and answered at the body's end, one answer per chunk.

    Envoy would send the headers upstream once answered, before the destination is known: the
    headers answer asks for BUFFERED instead (the chunks are still held should Envoy not allow
    the override), or, when Envoy sends the body without waiting for it, waits for the body
    and goes out first, carrying the destination."""

    asks_buffered = True

    def __init__(self, holds_headers: bool) -> None:
        self.holds_headers = holds_headers

    def body(self, exchange: RoutingExchange, body: pb.HttpBody) -> Replies:
        """Hold the chunk; at the body's end, route it and answer every chunk."""
        refused = exchange.hold(body.body)
        if refused is not None:
            return refused
        if not body.end_of_stream:
            return ()  # each chunk's answer waits until the whole body is known
        return exchange.answer_body(*exchange.take_held(), headers_held=self.holds_headers)

    def trailers(self, exchange: RoutingExchange) -> Replies:
        """Route the held body, if any, and answer every chunk."""
        if not exchange.held_chunks:
            return ()
        return exchange.answer_body(*exchange.take_held(), headers_held=self.holds_headers)


class UntoldBody(BodyMode):
    """No ``protocol_config`` (Envoy before 1.34, other ext_proc clients): taken to wait for
    each answer, as Envoy does by default. BUFFERED sends the body in one message that ends
    the stream, so a chunk that does not end it means the body is streamed (STREAMED, or a
    client that sends the body without waiting, as the llm-d router's EPP tests do)."""

    def body(self, exchange: RoutingExchange, body: pb.HttpBody) -> Replies:
        """A body whole in one message as BUFFERED, any other as STREAMED."""
        if exchange.held_chunks or not body.end_of_stream:
            return _STREAMED_BODY.body(exchange, body)
        return _BUFFERED_BODY.body(exchange, body)

    def trailers(self, exchange: RoutingExchange) -> Replies:
        """As STREAMED: a held body is answered."""
        return _STREAMED_BODY.trailers(exchange)


class FullDuplexBody(BodyMode):
    """FULL_DUPLEX_STREAMED: Envoy sends the body without waiting and expects no answer per
    message. The body is held, whole, up to :data:`MAX_HELD_BODY`; at its end the held
    headers answer goes out with the destination, then the body, sent back in streamed
    chunks."""

    holds_headers = True
    answers_each_message = False

    def body(self, exchange: RoutingExchange, body: pb.HttpBody) -> Replies:
        """Hold the chunk; at the body's end, route it and send it back."""
        refused = exchange.hold(body.body)
        if refused is not None:
            return refused
        if not body.end_of_stream:
            return ()
        return exchange.answer_duplex(end_of_stream=True)

    def trailers(self, exchange: RoutingExchange) -> Replies:
        """Route the held body (an empty one, when none came) and send it back."""
        return exchange.answer_duplex(end_of_stream=False)


_BUFFERED_BODY = BufferedBody()
_NO_BODY = NoBody()
_STREAMED_BODY = StreamedBody(holds_headers=False)
_STREAMED_BODY_WITHOUT_WAITING = StreamedBody(holds_headers=True)
_UNTOLD_BODY = UntoldBody()
_FULL_DUPLEX_BODY = FullDuplexBody()


def _body_mode(mode: int, config: pb.ProtocolConfiguration) -> BodyMode:
    """The request body ``mode`` Envoy says it uses (in ``config``)."""
    if mode == DUPLEX:
        return _FULL_DUPLEX_BODY
    if mode == STREAMED:
        return (_STREAMED_BODY_WITHOUT_WAITING
                if config.send_body_without_waiting_for_header_response else _STREAMED_BODY)
    if mode == NONE:
        return _NO_BODY
    return _BUFFERED_BODY


class ResponsePass:
    """The response as it passes a stream: the body modes Envoy uses (``request_mode`` is
    restated in any ``mode_override``), and the :class:`ResponseRewriter` that puts the
    requested name back and reads the usage. In FULL_DUPLEX_STREAMED every body chunk comes
    back through the picker; in the other modes each answer may change or keep its chunk."""

    __slots__ = ("_buffered", "_p", "mode", "request_mode", "rewriter")

    def __init__(self, processor: Processor, request_mode: int, mode: int) -> None:
        self._p = processor
        self.request_mode = request_mode
        self.mode = mode
        self.rewriter: ResponseRewriter | None = None
        self._buffered = False

    @property
    def usage(self) -> Usage | None:
        """The usage the response reported, when its body passed here."""
        return self.rewriter.usage if self.rewriter is not None else None

    def headers(self, headers: pb.HttpHeaders, requested: str | None) -> Replies:
        """Answer the response headers; with ``requested``, ask for the body (BUFFERED for
        JSON, STREAMED for Server-Sent Events) to put that name back."""
        if self.mode == DUPLEX:
            return self._duplex_headers(headers, requested)
        if headers.end_of_stream or (requested is None and self.mode == NONE):
            return (self._p.response_headers_continue,)
        sse = _is_event_stream(headers)
        if requested is None:  # the body passes here anyway: read its usage
            self.rewriter = ResponseRewriter(None, sse)
            self._buffered = self.mode == BUFFERED
            return (self._p.response_headers_continue,)
        self.rewriter = ResponseRewriter(requested, sse)
        reply = pb.ProcessingResponse()
        common = reply.response_headers.response
        wanted = STREAMED if sse else BUFFERED
        if self.mode != wanted:
            reply.mode_override.request_body_mode = self.request_mode
            reply.mode_override.response_body_mode = wanted
        self._buffered = wanted == BUFFERED
        if not self._buffered:
            # Chunks change length as they pass: let Envoy frame the body instead.
            common.header_mutation.remove_headers.append("content-length")
        else:
            common.SetInParent()
        return (reply,)

    def read(self, headers: pb.HttpHeaders) -> pb.ProcessingResponse:
        """``--record-responses``: ask for the body (BUFFERED JSON, STREAMED events) to read its
        usage and first byte; nothing of it is changed (a rewritten model name is put back by
        Envoy's response-rewrite filter)."""
        sse = _is_event_stream(headers)
        self.rewriter = ResponseRewriter(None, sse)
        reply = pb.ProcessingResponse()
        reply.response_headers.response.SetInParent()
        reply.mode_override.request_body_mode = self.request_mode
        reply.mode_override.response_body_mode = STREAMED if sse else BUFFERED
        self.mode = reply.mode_override.response_body_mode
        self._buffered = not sse
        return reply

    def _duplex_headers(self, headers: pb.HttpHeaders, requested: str | None) -> Replies:
        """FULL_DUPLEX_STREAMED: a rewriter (a pass-through one reading usage, unless the name
        is put back) always runs; its chunks change length when rewriting, so Envoy frames
        the body then."""
        if headers.end_of_stream:
            return (self._p.response_headers_continue,)
        self.rewriter = ResponseRewriter(requested, _is_event_stream(headers))
        if requested is None:
            return (self._p.response_headers_continue,)
        reply = pb.ProcessingResponse()
        reply.response_headers.response.header_mutation.remove_headers.append("content-length")
        return (reply,)

    def body(self, body: pb.HttpBody) -> Replies:
        """The chunk, rewritten or not: sent back (FULL_DUPLEX_STREAMED), or its answer."""
        rewriter = self.rewriter
        if self.mode == DUPLEX:
            new = rewriter.feed(body.body, body.end_of_stream) if rewriter is not None else None
            return _streamed_bodies(body.body if new is None else new, body.end_of_stream,
                                    request=False)
        if rewriter is None:
            return (self._p.response_body_continue,)
        new = rewriter.feed(body.body, body.end_of_stream)
        if new is None:
            return (self._p.response_body_continue,)
        reply = pb.ProcessingResponse()
        common = reply.response_body.response
        if new:
            common.body_mutation.body = new
        else:
            common.body_mutation.clear_body = True
        if self._buffered and body.end_of_stream:
            _set_header(common.header_mutation, "content-length", str(len(new)).encode())
        return (reply,)

    def trailers(self) -> Replies:
        """FULL_DUPLEX_STREAMED trailers after a body whose last chunk did not end the stream:
        whatever the rewriter holds goes out before the trailers' answer."""
        if self.mode != DUPLEX or self.rewriter is None:
            return (self._p.response_trailers_continue,)
        held = self.rewriter.feed(b"", True) or b""
        replies = list(_streamed_bodies(held, False, request=False)) if held else []
        replies.append(self._p.response_trailers_continue)
        return tuple(replies)


def _with_served_header(replies: Replies, metadata: base_pb2.Metadata) -> Replies:
    """``--conformance-test-headers``: the response headers' answer (the first of ``replies``;
    a copy, as it may be a shared prebuilt one) also sets the served-endpoint header."""
    reply = pb.ProcessingResponse()
    reply.CopyFrom(replies[0])
    _set_header(reply.response_headers.response.header_mutation, conformance.SERVED_HEADER,
                conformance.served_value(metadata))
    return (reply, *replies[1:])


def _streamed_bodies(body: bytes, end_of_stream: bool, *, request: bool) -> Replies:
    """``body`` as FULL_DUPLEX_STREAMED body answers (streamed body mutations of at most
    :data:`DUPLEX_CHUNK` bytes; ``end_of_stream`` on the last); one empty answer for an
    empty body."""
    replies = []
    for start in range(0, max(len(body), 1), DUPLEX_CHUNK):
        reply = pb.ProcessingResponse()
        answer = reply.request_body if request else reply.response_body
        streamed = answer.response.body_mutation.streamed_response
        streamed.body = body[start:start + DUPLEX_CHUNK]
        streamed.end_of_stream = end_of_stream and start + DUPLEX_CHUNK >= len(body)
        replies.append(reply)
    return tuple(replies)


def _header(headers: pb.HttpHeaders, key: str) -> bytes | None:
    for header in headers.headers.headers:
        if header.key == key:
            return header.raw_value or header.value.encode()
    return None


def _text(value: bytes | None) -> str:
    return value.decode(errors="replace") if value is not None else ""


def _status(headers: pb.HttpHeaders) -> int:
    """The response's ``:status`` (0 when missing or not a number)."""
    status = _header(headers, ":status")
    return int(status) if status is not None and status.isdigit() else 0


def _is_event_stream(headers: pb.HttpHeaders) -> bool:
    content_type = _header(headers, "content-type")
    return content_type is not None and content_type.startswith(_EVENT_STREAM)


PROCESS_PATH = b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"


class ProcessStream:
    """One ``Process`` call on the built-in HTTP/2 server: serialized messages in and out."""

    __slots__ = ("_exchange", "_processor")

    def __init__(self, processor: Processor) -> None:
        self._processor = processor
        self._exchange = Exchange(processor)

    def on_message(self, message: bytes) -> tuple[list[bytes], bool]:
        """The serialized answers to one message; True ends the call (after a picker error)."""
        try:
            replies = self._exchange.handle(pb.ProcessingRequest.FromString(message))
        except Exception as exc:  # undecodable or a bug: it must cost one request, not more
            return [self._processor.internal_error(exc).SerializeToString()], True
        return [reply.SerializeToString() for reply in replies], False

    def on_close(self) -> None:
        """The call ended: the request is no longer in flight."""
        self._exchange.close()


def http2_handlers(processor: Processor) -> dict[bytes, Callable[[], ProcessStream]]:
    """The built-in server's method table: ``Process`` only."""
    return {PROCESS_PATH: lambda: ProcessStream(processor)}


class ExternalProcessor(external_processor_pb2_grpc.ExternalProcessorServicer):
    """The grpc.aio servicer: runs an :class:`Exchange` per stream."""

    def __init__(self, processor: Processor) -> None:
        self._processor = processor

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        """Answer Envoy's messages for one HTTP request until Envoy closes the stream."""
        # context.read()/write() costs less CPU per message than the async-iterator style.
        exchange = Exchange(self._processor)
        try:
            while True:
                message = await context.read()
                if message is grpc.aio.EOF:
                    return
                try:
                    replies = exchange.handle(message)
                except Exception as exc:  # a bug must cost one request, not the stream
                    await context.write(self._processor.internal_error(exc))
                    return
                for reply in replies:
                    await context.write(reply)
        finally:
            exchange.close()
