"""The flight recorder's records: what a picker decided, on which view, and what came of it.

A picker publishes them in :class:`RecordBatch` messages on ``<prefix>.records.<pool>``
(``Subjects.records``), recorded server-side in ``<PREFIX>_DECISIONS`` beside the decision
stream; peers do not read them. A :class:`DecisionRecord` holds everything needed to run the
same policy again on the same input and get the same answer (``lig replay --what-if``,
``lig explain --recording``): the request as the policy saw it, the pod views it ran on, and the
random draw. An :class:`OutcomeRecord` follows when the request ends. Field order is the wire
contract (positional arrays); new fields go last, with defaults.
"""

from __future__ import annotations

import msgspec

from scheduling.types import PodView
from shared.schemas import SCHEMA_VERSION, Criticality

MAX_REQUEST_ID = 200
"""Bytes of a request id kept in records: a client may send its own ``x-request-id``, of any
length."""


def recorded_request_id(raw: bytes) -> str:
    """``raw`` (an ``x-request-id`` header's bytes) as records keep it: its first
    :data:`MAX_REQUEST_ID` bytes, invalid UTF-8 replaced. ``lig explain --recording`` cuts the
    id it is given the same way, so a longer id still finds its records."""
    return raw[:MAX_REQUEST_ID].decode(errors="replace")


class DecisionRecord(msgspec.Struct, frozen=True, array_like=True, tag="d"):
    """One scheduling decision.

    ``request_id`` is Envoy's ``x-request-id`` ("" when the request carried none); ``seq`` the
    router's decision number (``RoutedEvent.request_id`` in the decision stream). ``policy`` is
    the policy's name; its parameters are the pool's, in the recorded registry state.
    ``prefix_blocks`` is how many prompt blocks were hashed and ``prefix_hits`` the prefix
    index's matches (pod -> leading blocks). ``draw`` is the decision's random input (a uint64
    from which every random choice of the decision derives), ``view`` the pods the policy ran
    on, in the order it saw them. ``pick`` is the chosen pod's name (None: shed or no pod),
    ``fallbacks`` the endpoints offered after it.
    """

    request_id: str
    seq: int
    time_ns: int
    model: str
    target_model: str
    criticality: Criticality
    prompt_tokens: int
    max_tokens: int
    prefix_blocks: int
    prefix_hits: dict[str, int]
    policy: str
    draw: int
    view: tuple[PodView, ...]
    pick: str | None
    shed: bool = False
    fallbacks: tuple[str, ...] = ()


class OutcomeRecord(msgspec.Struct, frozen=True, array_like=True, tag="o"):
    """How a routed request ended, as the picker saw its response.

    ``served`` is the pod that answered, by name (the pick, or a fallback Envoy moved to);
    ``status`` the HTTP status (0: the picker did not see the response's headers: the stream
    ended before a response, or, without ``lig picker --record-responses``, the response was not
    one the gray-pod guard sampled); ``ttfb_ms`` the time from the decision to the response's
    first body byte (None: no body seen); ``duration_ms`` from the decision to the end; token
    counts from the response's usage (None: not reported or not seen). ``cached_tokens`` is
    the usage's ``prompt_tokens_details.cached_tokens``, the prompt tokens ``served`` found in
    its prefix cache (None: not reported: vLLM reports it with
    ``--enable-prompt-tokens-details``), ``predicted_cached_tokens`` the prompt tokens the
    picker's prefix index expected ``served`` to have cached (None: recorded by a picker that
    predates the field). docs/recording.md, "Decision records", says when the picker sees what.
    """

    request_id: str
    seq: int
    served: str
    status: int
    ttfb_ms: float | None
    duration_ms: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    predicted_cached_tokens: int | None = None


Record = DecisionRecord | OutcomeRecord


class RecordBatch(msgspec.Struct, frozen=True):
    """The records one picker made for one pool within a few milliseconds."""

    picker: str
    pool: str
    sent_at_ns: int
    records: list[Record]
    schema: int = SCHEMA_VERSION
