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

:class:`Exchange` is the pure per-stream logic, testable with protobuf objects and no network;
:class:`ProcessStream` runs it on the built-in HTTP/2 server (:mod:`protocols.http2`), and
:class:`ExternalProcessor` is the grpc.aio servicer around it.
"""

from __future__ import annotations

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
from services.picker.responses import ResponseRewriter
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


def _set_header(mutation: pb.HeaderMutation, key: str, value: bytes) -> None:
    # Envoy reads raw_value (bytes); it leaves `value` empty in what it sends, too.
    option = mutation.set_headers.add()
    option.header.key = key
    option.header.raw_value = value
    option.append_action = _OVERWRITE


class Processor:
    """What every stream shares: the gateway (pools, routers, pod tables), metrics and prebuilt
    answers.

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
    """One HTTP request's ext_proc conversation: what came in, and the answers to send."""

    __slots__ = ("_body_ended", "_chunks", "_held_bytes", "_held_chunks", "_hold_headers",
                 "_mode_told", "_objective", "_p", "_refused", "_reports_status", "_request_id",
                 "_request_mode", "_response_buffered", "_response_mode", "_rewrite_to",
                 "_rewriter", "_seen", "_selection", "_served_seen", "_subset", "routed")

    def __init__(self, processor: Processor) -> None:
        self._p = processor
        self.routed: Routed | None = None
        self._request_mode = BUFFERED
        self._response_mode = NONE
        self._mode_told = False  # Envoy sent protocol_config (1.34 and later do)
        self._hold_headers = False
        # The request body as it arrives, while its answers wait for its end.
        self._chunks: list[bytes] = []
        self._held_chunks = 0
        self._held_bytes = 0
        self._body_ended = False  # the request body's end was answered (routed or refused)
        self._refused = False  # an ImmediateResponse ended the request: nothing more is answered
        self._rewriter: ResponseRewriter | None = None
        self._rewrite_to: str | None = None  # the requested name, when the response needs it
        self._response_buffered = False
        self._reports_status = False  # Envoy sends this stream the response headers for it
        self._subset: frozenset[str] | None = None  # the gateway's subset hint
        self._objective: str | None = None  # the InferenceObjective the request names
        self._selection: conformance.Selection | None = None  # --conformance-test-headers
        self._served_seen = False
        self._request_id = ""  # Envoy's x-request-id, when recording
        self._seen: ResponseSeen | None = None  # what passed of the response, when recording

    def handle(self, message: pb.ProcessingRequest) -> tuple[pb.ProcessingResponse, ...]:
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
            if self._rewrite_to is None and message.HasField("protocol_config"):
                self._start_with_response(message)  # an earlier bootstrap's rewrite stream
            replies = self._response_headers(message.response_headers)
            if self._p.conformance and self.routed is not None:
                return _with_served_header(replies, message.metadata_context)
            return replies
        if kind == "response_body":
            return self._response_body(message.response_body)
        if kind == "request_trailers":
            return self._request_trailers()
        if kind == "response_trailers":
            if self._response_mode == DUPLEX and self._rewriter is not None:
                return self._duplex_response_end()
            return (self._p.response_trailers_continue,)
        return ()

    def _take_served(self, metadata: base_pb2.Metadata) -> None:
        served = epp.served_endpoint(metadata)
        if served is not None and self.routed is not None:
            self._served_seen = True
            self.routed = self._p.served(self.routed, served)

    def close(self) -> None:
        """The stream ended: the request is no longer in flight; count its token usage (read
        when this stream saw the response body: ``--record-responses``, FULL_DUPLEX_STREAMED)."""
        routed = self.routed
        if routed is None:
            return
        usage = self._rewriter.usage if self._rewriter is not None else None
        if usage is None:
            self._p.gateway.finished(routed, response=self._seen)
            return
        self._p.gateway.finished(routed, usage.prompt_tokens, usage.completion_tokens, self._seen,
                                 usage.cached_tokens)
        if usage.cached_tokens is not None:
            self._p.metrics.count_reuse(routed.pool, routed.cached_on(routed.pod),
                                        usage.cached_tokens)
        self._p.metrics.count_tokens(routed.model, routed.registered, usage)

    # --- request -------------------------------------------------------------------------

    def _request_headers(self, message: pb.ProcessingRequest) -> tuple[pb.ProcessingResponse, ...]:
        # A new request (Envoy sends one per stream; a peer may send more): its body starts.
        self._chunks = []
        self._held_chunks = self._held_bytes = 0
        self._body_ended = self._refused = False
        if message.HasField("protocol_config"):
            self._mode_told = True
            config = message.protocol_config
            self._request_mode = config.request_body_mode
            self._response_mode = config.response_body_mode
            # FULL_DUPLEX_STREAMED sends the body without waiting, too; the headers answer
            # carries the destination, so it waits for the whole body.
            self._hold_headers = config.request_body_mode == DUPLEX or (
                config.send_body_without_waiting_for_header_response
                and config.request_body_mode == STREAMED)
        if message.HasField("metadata_context"):
            self._subset = epp.subset_hint(message.metadata_context)
        if self._p.conformance:
            self._selection = conformance.selection(message.request_headers)
        if self._request_mode == NONE:
            requested = _header(message.request_headers, REWRITE_HEADER)
            if requested is not None:  # an earlier bootstrap's rewrite stream
                self._rewrite_to = urllib.parse.unquote(requested.decode(errors="replace"))
                return (self._p.rewrite_headers_continue,)
        if message.request_headers.end_of_stream or self._request_mode == NONE:
            headers = message.request_headers
            self._body_ended = True
            return (self._answer_headers_with(self._p.route(
                None, self._subset, method=_text(_header(headers, ":method")),
                path=_text(_header(headers, ":path")), selection=self._selection)),)
        # Only a request with a body is scheduled, so only it needs the objective header.
        self._objective = epp.objective(message.request_headers)
        if self._p.recording:
            self._request_id = epp.request_id(message.request_headers)
        if self._hold_headers:
            return ()
        self._reports_status = self._p.gateway.wants_outcome() or self._p.record_responses
        # The conformance suite's served-endpoint header goes on the response headers' answer.
        response_headers = self._reports_status or self._p.conformance
        if self._request_mode == STREAMED or response_headers:
            # STREAMED: Envoy would send the headers upstream before the body (and so the
            # destination) is known: ask for the body buffered instead. Chunks are still
            # accumulated below should Envoy not allow the override.
            return (self._p.headers_continue_buffered(self._response_mode, response_headers),)
        return (self._p.headers_continue,)

    def _answer_headers_with(self, result: Routed | Rejected) -> pb.ProcessingResponse:
        if isinstance(result, Rejected):
            return self._refuse(result)
        self._take(result)
        return self._headers_answer(result)

    def _headers_answer(self, routed: Routed) -> pb.ProcessingResponse:
        reply = pb.ProcessingResponse()
        common = reply.request_headers.response
        self._p.set_destination(reply, common, routed)
        return reply

    def _take(self, routed: Routed) -> None:
        # Envoy routes one request per stream, but a peer may route a second on the same
        # stream (headers or a body again): the request it replaces is no longer in flight,
        # and only the newest decision may ask for the response rewrite.
        if self.routed is not None:
            self._p.gateway.finished(self.routed)
        self.routed = routed
        self._rewrite_to = routed.model if routed.body is not None else None

    def _refuse(self, rejected: Rejected) -> pb.ProcessingResponse:
        """The ImmediateResponse ending this request: Envoy stops processing it, so whatever
        else of it arrives (chunks already on their way) is not answered again."""
        self._chunks = []
        self._refused = True
        return self._p.immediate(rejected)

    def _streams_body(self, body: pb.HttpBody) -> bool:
        """Whether the body comes in several chunks answered at its end, rather than whole in
        one message (BUFFERED) answered at once.

        Told the mode (``protocol_config``), the mode decides. Not told (Envoy before 1.34,
        other ext_proc clients), the chunks do: BUFFERED sends the body in one message that
        ends the stream, so a chunk that does not end it means the body is streamed (STREAMED,
        or a client that sends the body without waiting, as the llm-d router's EPP tests do).
        """
        if self._mode_told:
            return self._request_mode == STREAMED
        return self._held_chunks > 0 or not body.end_of_stream

    def _hold(self, chunk: bytes) -> pb.ProcessingResponse | None:
        """Keep ``chunk`` until the body is complete; the 413 once the body is beyond
        :data:`MAX_HELD_BODY` (Envoy's own limit does not apply to a body it streams)."""
        self._held_bytes += len(chunk)
        if self._held_bytes > MAX_HELD_BODY:
            return self._refuse(self._p.too_large())
        self._chunks.append(chunk)
        self._held_chunks += 1
        return None

    def _take_held(self) -> tuple[bytes, int]:
        """The held body, whole, and the number of chunks it came in; nothing is held after."""
        chunks, count = self._chunks, self._held_chunks
        self._chunks = []
        self._held_chunks = 0
        return (chunks[0] if count == 1 else b"".join(chunks)), count

    def _request_body(self, body: pb.HttpBody) -> tuple[pb.ProcessingResponse, ...]:
        if self._refused:
            return ()
        if self._body_ended:
            return self._repeated_end()
        if self._request_mode == DUPLEX:
            refused = self._hold(body.body)
            if refused is not None:
                return (refused,)
            if not body.end_of_stream:
                return ()
            return self._duplex_request_end(with_trailers=False)
        if not self._streams_body(body):
            return self._answer_body(body.body, 1)
        refused = self._hold(body.body)
        if refused is not None:
            return (refused,)
        if not body.end_of_stream:
            return ()  # each chunk's answer waits until the whole body is known
        return self._answer_body(*self._take_held())

    def _repeated_end(self) -> tuple[pb.ProcessingResponse, ...]:
        """A request body message after the body ended (Envoy issue #46237 repeats the last
        chunk, with end of stream, of FULL_DUPLEX_STREAMED bodies of 1 MB or more): the
        request was routed on the first end, and is not routed again.

        FULL_DUPLEX_STREAMED expects no answer per message, and the body already went back
        with its end of stream: any further body answer would be spurious, so there is none.
        In the other modes Envoy expects exactly one answer per message: an empty body answer,
        which changes nothing."""
        self._p.repeated_end()
        if self._request_mode == DUPLEX:
            return ()
        return (self._p.request_body_continue,)

    def _request_trailers(self) -> tuple[pb.ProcessingResponse, ...]:
        """The trailers end a body whose last chunk did not: a held body is answered first."""
        if self._refused:
            return ()
        if self._body_ended:
            return (self._p.request_trailers_continue,)
        if self._request_mode == DUPLEX:  # headers still held
            return self._duplex_request_end(with_trailers=True)
        if self._held_chunks:
            answers = self._answer_body(*self._take_held())
            if answers[0].HasField("immediate_response"):  # the request ends there
                return answers
            return (*answers, self._p.request_trailers_continue)
        return (self._p.request_trailers_continue,)

    def _duplex_request_end(self, with_trailers: bool) -> tuple[pb.ProcessingResponse, ...]:
        """FULL_DUPLEX_STREAMED: the whole body is here (its last chunk, or the trailers that
        follow it). Answer in the order Envoy requires: the headers (with the destination),
        the body sent back as streamed chunks (rewritten when the model was), then the
        trailers."""
        self._body_ended = True
        whole = b"".join(self._chunks)
        self._chunks = []
        self._held_chunks = 0
        result = self._p.route(whole, self._subset, self._objective, request_id=self._request_id,
                               selection=self._selection)
        if isinstance(result, Rejected):
            return (self._refuse(result),)
        replies = [self._answer_headers_with(result)]
        self._reports_status = self._p.gateway.wants_outcome() or self._p.record_responses
        replies.extend(_streamed_bodies(
            result.body if result.body is not None else whole, not with_trailers, request=True))
        if with_trailers:
            replies.append(self._p.request_trailers_continue)
        return tuple(replies)

    def _answer_body(self, body: bytes, chunks: int) -> tuple[pb.ProcessingResponse, ...]:
        """Route the complete body that came in ``chunks`` messages: one answer per message,
        in order (an ImmediateResponse ends the request instead)."""
        self._body_ended = True
        result = self._p.route(body, self._subset, self._objective, request_id=self._request_id,
                               selection=self._selection)
        if isinstance(result, Rejected):
            return (self._refuse(result),)
        self._take(result)
        replies: list[pb.ProcessingResponse] = []
        if self._hold_headers:  # taken above: taking it again would finish it at once
            replies.append(self._headers_answer(result))
        # One answer per chunk, in order. The destination rides on the first answer Envoy
        # reads before it forwards the headers; a rewritten body replaces the last chunk and
        # the earlier ones are cleared.
        for index in range(chunks):
            carries_destination = index == 0 and not self._hold_headers
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

    # --- response ------------------------------------------------------------------------

    def _start_with_response(self, message: pb.ProcessingRequest) -> None:
        """A stream whose first message is the response headers: the body mode Envoy uses, and
        the requested name from the routing answer's dynamic metadata (when it was rewritten)."""
        self._request_mode = message.protocol_config.request_body_mode
        self._response_mode = message.protocol_config.response_body_mode
        fields = message.metadata_context.filter_metadata.get(METADATA_NAMESPACE)
        if fields is not None:
            requested = fields.fields.get(REQUESTED_MODEL_KEY)
            if requested is not None and requested.string_value:
                self._rewrite_to = requested.string_value

    def _response_headers(self, headers: pb.HttpHeaders) -> tuple[pb.ProcessingResponse, ...]:
        if self._p.recording and self.routed is not None:
            self._seen = ResponseSeen(_status(headers))
        if self._response_mode == DUPLEX:
            return self._duplex_response_headers(headers)
        if self._reports_status:
            self._reports_status = False
            if self.routed is not None:
                self._p.gateway.responded(self.routed, _status(headers))
                if self._p.record_responses and not headers.end_of_stream:
                    return (self._read_response(headers),)
            return (self._p.response_headers_continue,)  # Envoy puts the name back
        rewrite_to = self._rewrite_to
        if headers.end_of_stream or (rewrite_to is None and self._response_mode == NONE):
            return (self._p.response_headers_continue,)
        sse = _is_event_stream(headers)
        wanted = STREAMED if sse else BUFFERED
        if rewrite_to is None:
            self._rewriter = ResponseRewriter(None, sse)
            self._response_buffered = self._response_mode == BUFFERED
            return (self._p.response_headers_continue,)
        self._rewriter = ResponseRewriter(rewrite_to, sse)
        reply = pb.ProcessingResponse()
        common = reply.response_headers.response
        mode = self._response_mode
        if mode != wanted:
            reply.mode_override.request_body_mode = self._request_mode
            reply.mode_override.response_body_mode = wanted
            mode = wanted
        self._response_buffered = mode == BUFFERED
        if not self._response_buffered:
            # Chunks change length as they pass: let Envoy frame the body instead.
            common.header_mutation.remove_headers.append("content-length")
        else:
            common.SetInParent()
        return (reply,)

    def _read_response(self, headers: pb.HttpHeaders) -> pb.ProcessingResponse:
        """``--record-responses``: ask for the body (BUFFERED JSON, STREAMED events) to read its
        usage and first byte; nothing of it is changed (a rewritten model name is put back by
        Envoy's response-rewrite filter)."""
        sse = _is_event_stream(headers)
        self._rewriter = ResponseRewriter(None, sse)
        reply = pb.ProcessingResponse()
        reply.response_headers.response.SetInParent()
        reply.mode_override.request_body_mode = self._request_mode
        reply.mode_override.response_body_mode = STREAMED if sse else BUFFERED
        self._response_mode = reply.mode_override.response_body_mode
        self._response_buffered = not sse
        return reply

    def _duplex_response_headers(self, headers: pb.HttpHeaders
                                 ) -> tuple[pb.ProcessingResponse, ...]:
        """FULL_DUPLEX_STREAMED response: every body chunk must come back through the picker,
        so a rewriter (a pass-through one reading usage, unless the model is put back) always
        runs; its chunks change length when rewriting, so Envoy frames the body then."""
        if self._reports_status and self.routed is not None:
            self._reports_status = False
            self._p.gateway.responded(self.routed, _status(headers))
        if headers.end_of_stream:
            return (self._p.response_headers_continue,)
        self._rewriter = ResponseRewriter(self._rewrite_to, _is_event_stream(headers))
        if self._rewrite_to is None:
            return (self._p.response_headers_continue,)
        reply = pb.ProcessingResponse()
        reply.response_headers.response.header_mutation.remove_headers.append("content-length")
        return (reply,)

    def _duplex_response_end(self) -> tuple[pb.ProcessingResponse, ...]:
        """Response trailers after a body whose last chunk did not end the stream: whatever
        the rewriter holds goes out before the trailers' answer."""
        assert self._rewriter is not None
        held = self._rewriter.feed(b"", True) or b""
        replies = list(_streamed_bodies(held, False, request=False)) if held else []
        replies.append(self._p.response_trailers_continue)
        return tuple(replies)

    def _response_body(self, body: pb.HttpBody) -> tuple[pb.ProcessingResponse, ...]:
        seen = self._seen
        if seen is not None and not seen.first_byte_ns and body.body:
            seen.first_byte_ns = time.perf_counter_ns()
        if self._response_mode == DUPLEX:
            new = (self._rewriter.feed(body.body, body.end_of_stream)
                   if self._rewriter is not None else None)
            return _streamed_bodies(body.body if new is None else new, body.end_of_stream,
                                    request=False)
        rewriter = self._rewriter
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
        if self._response_buffered and body.end_of_stream:
            _set_header(common.header_mutation, "content-length", str(len(new)).encode())
        return (reply,)


def _with_served_header(replies: tuple[pb.ProcessingResponse, ...], metadata: base_pb2.Metadata
                        ) -> tuple[pb.ProcessingResponse, ...]:
    """``--conformance-test-headers``: the response headers' answer (the first of ``replies``;
    a copy, as it may be a shared prebuilt one) also sets the served-endpoint header."""
    reply = pb.ProcessingResponse()
    reply.CopyFrom(replies[0])
    _set_header(reply.response_headers.response.header_mutation, conformance.SERVED_HEADER,
                conformance.served_value(metadata))
    return (reply, *replies[1:])


def _streamed_bodies(body: bytes, end_of_stream: bool, *, request: bool
                     ) -> tuple[pb.ProcessingResponse, ...]:
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
