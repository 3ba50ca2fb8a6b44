"""Wire messages shared by the services (msgspec Structs, msgpack on NATS).

Every message carries ``schema``, the version of this file's contract; decoders reject other
versions so that a mixed-version fleet fails loudly instead of misreading fields.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol, TypeVar

import msgspec

from shared.errors import LigError

SCHEMA_VERSION = 1


class Criticality(enum.StrEnum):
    """How much a request matters when the fleet is saturated (InferenceModel.criticality)."""

    CRITICAL = "Critical"
    STANDARD = "Standard"
    SHEDDABLE = "Sheddable"


class Endpoint(msgspec.Struct, frozen=True):
    """One model-server pod of a pool."""

    name: str
    address: str
    port: int
    labels: dict[str, str] = {}

    @property
    def hostport(self) -> str:
        """``ip:port`` as Envoy's ORIGINAL_DST cluster expects it."""
        return f"{self.address}:{self.port}"


class EndpointSet(msgspec.Struct, frozen=True):
    """The current members of a pool (KV key ``endpoints.<pool>``)."""

    pool: str
    endpoints: tuple[Endpoint, ...] = ()
    schema: int = SCHEMA_VERSION


DEFAULT_POLICY_NAME = "prefix-aware"
"""The scheduling policy of a pool that names none (chosen by the benchmark, docs/benchmarks.md)."""


class PolicyConfig(msgspec.Struct, frozen=True):
    """Which scheduling policy a pool uses, and its parameters (thresholds) by name."""

    name: str = DEFAULT_POLICY_NAME
    params: dict[str, Any] = {}


class InferencePool(msgspec.Struct, frozen=True):
    """A pool of model servers (KV key ``pool.<pool>``); mirrors the InferencePool CRD."""

    name: str
    target_port: int
    selector: dict[str, str] = {}
    metrics_path: str = "/metrics"
    metrics_port: int | None = None
    policy: PolicyConfig = PolicyConfig()
    reject_unknown_models: bool = False
    # InferenceObjective names of this pool and the criticality each gives a request that names
    # it in the objective header (filled by the Kubernetes source).
    objectives: dict[str, Criticality] = {}
    schema: int = SCHEMA_VERSION


class TargetModel(msgspec.Struct, frozen=True):
    """A model or LoRA adapter that serves part of an InferenceModel's traffic."""

    name: str
    weight: int = 1


class InferenceModel(msgspec.Struct, frozen=True):
    """A client-facing model name (KV key ``model.<pool>.<model>``); mirrors the CRD."""

    model_name: str
    pool: str
    criticality: Criticality = Criticality.STANDARD
    target_models: tuple[TargetModel, ...] = ()
    schema: int = SCHEMA_VERSION


class PodMetrics(msgspec.Struct, frozen=True):
    """One scrape of one pod, published on ``<prefix>.metrics.<pool>.<pod>``.

    A failed scrape has ``ok=False``, ``error`` set and zeroed metric fields. ``missing`` lists
    the metric families the page lacked (their fields keep their defaults).
    """

    pool: str
    pod: str
    address: str
    seq: int
    scrape_time_ns: int
    scrape_duration_s: float
    ok: bool
    error: str | None = None
    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    max_lora: int | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    missing: tuple[str, ...] = ()
    schema: int = SCHEMA_VERSION


class CollectorHeartbeat(msgspec.Struct, frozen=True):
    """A collector announcing itself on ``<prefix>.collectors.<id>`` so collectors share pods.

    ``active`` is false while a new collector is still learning its peers (it owns no pods yet);
    ``leaving`` says it is stopping, so peers take its pods over at once.
    """

    collector_id: str
    interval_s: float
    active: bool = True
    leaving: bool = False
    schema: int = SCHEMA_VERSION


class RoutedEvent(msgspec.Struct, frozen=True, tag="r", array_like=True):
    """A picker sent request ``request_id`` (unique per picker and pool) to ``pod``.

    ``prompt_tokens`` is the picker's estimate of the prompt's size, ``max_tokens`` the
    request's limit (0: unknown or unset); ``prefix_hashes`` are the chained hashes of the
    prompt's blocks (empty when the picker does not hash prompts). ``prefill_tokens`` is the
    part of ``prompt_tokens`` the picker expects ``pod`` to compute, the rest being in its prefix
    cache per the picker's prefix index: what peers count as the pod's unreported load (None:
    all of ``prompt_tokens``, as nothing is cached or the picker predates the field). Last, so
    that older peers, which ignore trailing fields, still decode the event.
    """

    request_id: int
    pod: str
    target_model: str
    criticality: Criticality
    prompt_tokens: int = 0
    max_tokens: int = 0
    prefix_hashes: tuple[int, ...] = ()
    prefill_tokens: int | None = None


class FinishedEvent(msgspec.Struct, frozen=True, tag="f", array_like=True):
    """Request ``request_id`` sent to ``pod`` has ended (response done or stream closed);
    the token counts come from the response's usage when the picker saw it (None: unknown)."""

    request_id: int
    pod: str
    prompt_tokens: int = 0
    completion_tokens: int | None = None


class ShedEvent(msgspec.Struct, frozen=True, tag="s", array_like=True):
    """Request ``request_id`` was shed (429) because every pod was saturated."""

    request_id: int
    target_model: str
    criticality: Criticality


DecisionEvent = RoutedEvent | FinishedEvent | ShedEvent


class DecisionBatch(msgspec.Struct, frozen=True):
    """The decisions one picker made for one pool within a few milliseconds, published on
    ``<prefix>.decisions.<pool>`` (docs/decision-stream.md).

    An empty ``events`` list is a heartbeat: the picker is alive and its earlier events still
    hold. ``heartbeat_s`` is how often it sends one when it has nothing else to say, so that its
    peers know when its silence means it is gone.
    """

    picker: str
    pool: str
    sent_at_ns: int
    events: list[DecisionEvent]
    heartbeat_s: float = 0.5
    schema: int = SCHEMA_VERSION


class DecodeError(LigError, ValueError):
    """A NATS payload could not be decoded into the expected message type."""


class Versioned(Protocol):
    """What :func:`decode` needs of a message type: every wire Struct above carries ``schema``."""

    @property
    def schema(self) -> int:
        """The version of this file's contract the sender wrote."""
        ...


M = TypeVar("M", bound=Versioned)

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}


def encode(message: msgspec.Struct) -> bytes:
    """Encode a message as msgpack for NATS."""
    return _encoder.encode(message)


def decode(data: bytes, message_type: type[M]) -> M:
    """Decode msgpack ``data`` as ``message_type``; raise :class:`DecodeError` on any failure."""
    decoder = _decoders.get(message_type)
    if decoder is None:
        decoder = _decoders[message_type] = msgspec.msgpack.Decoder(message_type)
    try:
        message: M = decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DecodeError(f"undecodable {message_type.__name__}: {exc}") from exc
    if message.schema != SCHEMA_VERSION:
        raise DecodeError(
            f"{message_type.__name__} has schema {message.schema}, expected {SCHEMA_VERSION}"
        )
    return message
