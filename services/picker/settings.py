"""``lig picker``'s settings: one field per flag (see :mod:`shared.host.settings`)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from scheduling.precise_index import DEFAULT_RECOVERY_S, DEFAULT_SPECULATIVE_TTL
from scheduling.prompt_tokenizers import parse_pool_specs
from services.picker.batch_sender import DEFAULT_DELAY
from services.picker.peer_decisions import DEFAULT_REQUEST_TTL
from services.picker.routing import DEFAULT_PRECISE_BLOCKS, DEFAULT_PREFIX_ENTRIES
from services.picker.tls import TlsFiles
from shared import ports
from shared.host.settings import option
from shared.logs import LogLevel
from shared.nats_connection import NatsSettings


class PickerSettings(msgspec.Struct, frozen=True):
    """Everything ``lig picker`` is configured with."""

    pools: Annotated[list[str], option(
        "an InferencePool this picker serves; repeat for several (comma-separated in the "
        "environment). Without it the picker serves every pool of the registry. Requests are "
        "routed to the pool that registers their model; model names must be unique across the "
        "pools served", flag="--pool")] = []
    default_pool: Annotated[str | None, option(
        "the pool that takes requests for models no served pool registers (its "
        "rejectUnknownModels field still applies). Default: the only pool when one is served, "
        "else none (404)")] = None
    reject_unknown_models: Annotated[bool, option(
        "answer 404 to every request for a model no served pool registers, whatever "
        "--default-pool and the pools' rejectUnknownModels say")] = False
    host: Annotated[str, option(
        "address the ext_proc, health and metrics ports listen on; loopback by default because "
        "ext_proc is plaintext unless --tls-cert is given: containers pass --host 0.0.0.0 "
        "explicitly")] = "127.0.0.1"
    grpc_port: Annotated[int, option("ext_proc gRPC port", ge=0)] = ports.PICKER_GRPC
    health_port: Annotated[int, option("gRPC health port", ge=0)] = ports.PICKER_HEALTH
    metrics_port: Annotated[int, option("Prometheus /metrics port (0 disables)", ge=0)] \
        = ports.PICKER_METRICS
    server: Annotated[Literal["builtin", "grpc-aio"], option(
        "the ext_proc server: 'builtin' (HTTP/2 in the event loop's thread; about a quarter of "
        "the CPU per request) or 'grpc-aio' (the grpcio library's asyncio server)",
        aliases=("LIG_PICKER_SERVER",))] = "builtin"
    workers: Annotated[int, option("processes sharing the ports (SO_REUSEPORT)", ge=1)] = 1
    drain_delay: Annotated[float, option(
        "seconds the picker goes on serving after SIGTERM while its health checks fail, so that "
        "Envoy (checking every second) has moved new requests to other replicas before this one "
        "closes (skipped by a picker that never became ready); responses already routed never "
        "depend on it", ge=0)] = 1.1
    stale_after: Annotated[float, option(
        "seconds after which a pod's newest snapshot is stale", gt=0)] = 1.0
    load_estimate: Annotated[bool, option(
        "count the requests this picker sent to a pod since its newest snapshot in that pod's "
        "waiting queue (beyond the least-served pod's), so that the requests of one scrape "
        "interval spread over the pods instead of all going to the least loaded one; "
        "--no-load-estimate decides on the scraped metrics alone, as upstream")] = True
    gray_after: Annotated[float, option(
        "seconds before a pod's newest snapshot arrived after which a request this picker sent "
        "to the pod, still unfinished, shows the pod gray if the pod reports fewer running and "
        "waiting requests than it has such requests (it is not running them); a gray pod is "
        "left out for a cool-off (5 s, doubling on repeats), then gets one request at a time "
        "until one succeeds. 0 disables this check", ge=0)] = 2.0
    outcome_sample: Annotated[int, option(
        "ask Envoy for the response status of one request in N (and of every request while a "
        "pod is left out or on probation); a pod whose recent responses are mostly 5xx is gray. "
        "0 never asks", metavar="N", ge=0)] = 4
    destination_header: Annotated[str, option(
        "request header naming the chosen pod (ip:port) for Envoy", min_length=1)] \
        = "x-gateway-destination-endpoint"
    fallbacks: Annotated[int, option(
        "endpoint picker protocol: name up to N fallback pods after the chosen one, in policy "
        "order, in the destination header and envoy.lb metadata (ip:port,ip:port,...), for a "
        "gateway that retries down the list. 0 (as the reference picker's maxNumOfEndpoints=1) "
        "names only the chosen pod, which is what an ORIGINAL_DST cluster (the shipped Envoy "
        "bootstrap) can route", metavar="N", ge=0)] = 0
    seed: Annotated[int | None, option("seed for the random choices (reproducible runs)")] = None
    # Prompt-aware scheduling (docs/scheduling.md).
    prefix_index_entries: Annotated[int, option(
        "per pool, the most prompt block hashes (1 KiB of prompt, about 256 tokens, each) the "
        "approximate prefix index keeps, least recently routed dropped first; about 200 bytes "
        "each (bench/bench_prefix.py). The prefix_affinity scorer of the prefix-aware policy "
        "reads it; 0 turns the index off. The default tracks about 16M prompt tokens, more than "
        "the KV caches of a typical pool hold", metavar="N", ge=0)] = DEFAULT_PREFIX_ENTRIES
    # Precise prefix routing from the pods' KV-cache events (issue 16, docs/kv-events.md).
    precise_blocks: Annotated[int, option(
        "per pool, the most KV-cache blocks the precise prefix index keeps from the pods' "
        "KV-cache events (<prefix>.kvblocks.<pool>.>, published by lig kv-events), the oldest "
        "blocks of the pod holding the most dropped first; about 165 bytes each "
        "(bench/bench_precise_index.py). Used for pools with a tokenizer, for the pods that "
        "publish events; 0 turns it off (and the subscription)", metavar="N", ge=0)] \
        = DEFAULT_PRECISE_BLOCKS
    precise_history: Annotated[bool, option(
        "when lig kv-events records the pods' KV block changes (JetStream <PREFIX>_KVBLOCKS), "
        "read the recording from its start before the live changes, so that a picker started "
        "after the pods knows the blocks they already hold (vLLM announces a block only when it "
        "enters the cache). It costs about 0.1 ms of CPU per recorded message at start (the "
        "recording keeps at most 1 GiB / 1 h by default). --no-precise-history: live changes "
        "only")] = True
    speculative_ttl: Annotated[float, option(
        "seconds a routed request's blocks count as cached on its pod in the precise index "
        "before the pod's events confirm them (they count up to 1.5 times that), so that a burst "
        "of one prefix does not miss meanwhile; 0 disables", metavar="SECONDS", ge=0)] \
        = DEFAULT_SPECULATIVE_TTL
    precise_recovery_s: Annotated[float, option(
        "seconds a pod's precise index state counts as incomplete after KV block changes were "
        "lost on the way (a gap in lig kv-events' numbering), the bridge resynced the pod, or "
        "the pod stored a block on a prefix the index does not hold (renewed at each): "
        "meanwhile the pod is also scored from the approximate index (the better count wins); "
        "an engine restart ends it at once", flag="--precise-recovery", metavar="SECONDS",
        ge=0)] = DEFAULT_RECOVERY_S
    tokenizers: Annotated[list[str], option(
        "POOL=SPEC: the tokenizer of a pool's model, so that the precise prefix index (fed by "
        "the pods' KV-cache events) can look requests up by their token ids; repeat for several "
        "pools (comma-separated in the environment). SPEC is a Hugging Face tokenizer.json on "
        "this picker's disk (or its directory; the chat template comes from the "
        "tokenizer_config.json or chat_template.jinja beside it) or builtin:lig-sim (lig sim's "
        "tokenizer). A pool without one uses the approximate prefix index. A file that cannot "
        "be loaded stops the picker at startup (exit 2)", flag="--tokenizer",
        metavar="POOL=SPEC")] = []
    # The decision stream (issue 11, docs/decision-stream.md).
    shared_decisions: Annotated[bool, option(
        "share routing decisions with the other picker replicas over NATS "
        "(<prefix>.decisions.<pool>): each counts its peers' requests in its load estimate as "
        "its own, so that N replicas decide like one. --no-shared-decisions counts only this "
        "picker's requests, for comparison")] = True
    decision_batch_delay: Annotated[float, option(
        "seconds a decision waits for others to share one NATS message", metavar="SECONDS",
        ge=0)] = DEFAULT_DELAY
    decision_request_ttl: Annotated[float, option(
        "seconds after which a peer's request still counted in flight without a finished event "
        "is dropped from the counts (a peer that goes silent is dropped after 4 of its 0.5 s "
        "heartbeats regardless)", metavar="SECONDS", gt=0)] = DEFAULT_REQUEST_TTL
    # The flight recorder (issue 14, docs/recording.md).
    record_decisions: Annotated[bool, option(
        "publish a record of every scheduling decision (the request as the policy saw it, the "
        "pod views it ran on, the random draw, the pick or the shed) and of how each routed "
        "request ended, on <prefix>.records.<pool>, for the server-side recording that `lig "
        "record` exports (replay, what-if, explain). --no-record-decisions publishes none")] \
        = True
    record_responses: Annotated[bool, option(
        "with --record-decisions: ask Envoy for every response's headers and body, so that each "
        "outcome record carries the HTTP status, the time to the first body byte and the token "
        "usage. Costs two more ext_proc messages per request (and every streamed chunk passes "
        "the picker); without it an outcome has the duration always, the status when the "
        "gray-pod guard sampled the response, and usage only when the picker saw the body")] \
        = False
    conformance_test_headers: Annotated[bool, option(
        "for the Gateway API Inference Extension's conformance suite only: pick among the pool "
        "endpoints a request's test-epp-endpoint-selection header names (IP or IP:port, "
        "comma-separated; none of them in the pool: 400 test_endpoint_not_in_pool) and answer "
        "the response headers with x-conformance-test-served-endpoint (the endpoint the gateway "
        "reports as having served the request). It lets any client choose its pod: never on in "
        "production")] = False
    tls_cert: Annotated[str | None, option(
        "PEM certificate chain: serve ext_proc over TLS (with --tls-key)",
        aliases=("LIG_PICKER_TLS_CERT",))] = None
    tls_key: Annotated[str | None, option(
        "PEM private key of --tls-cert", aliases=("LIG_PICKER_TLS_KEY",))] = None
    tls_client_ca: Annotated[str | None, option(
        "PEM CA bundle: require client certificates it signed, i.e. mutual TLS",
        aliases=("LIG_PICKER_TLS_CLIENT_CA",))] = None
    nats: NatsSettings = NatsSettings()
    log_level: LogLevel = "INFO"

    def __post_init__(self) -> None:
        # Duplicates dropped, order kept: "--pool a --pool a" serves one pool.
        msgspec.structs.force_setattr(
            self, "pools", list(dict.fromkeys(name.strip() for name in self.pools
                                              if name.strip())))
        if (self.default_pool is not None and not self.reject_unknown_models and self.pools
                and self.default_pool not in self.pools):
            raise ValueError(f"--default-pool (env LIG_DEFAULT_POOL) {self.default_pool} is not "
                             f"one of the pools served (--pool {' --pool '.join(self.pools)})")
        try:
            specs = parse_pool_specs(self.tokenizers)
        except ValueError as error:
            raise ValueError(f"--tokenizer (env LIG_TOKENIZER): {error}") from None
        unserved = [pool for pool in specs if self.pools and pool not in self.pools]
        if unserved:
            raise ValueError(f"--tokenizer (env LIG_TOKENIZER) names pool {unserved[0]}, which "
                             f"is not one of the pools served "
                             f"(--pool {' --pool '.join(self.pools)})")
        if (self.tls_cert or self.tls_key or self.tls_client_ca) and not (
                self.tls_cert and self.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key (env LIG_TLS_CERT and "
                             "LIG_TLS_KEY)")

    @property
    def tokenizer_specs(self) -> dict[str, str]:
        """``--tokenizer`` as pool -> spec (checked when the settings were built)."""
        return parse_pool_specs(self.tokenizers)

    @property
    def tls(self) -> TlsFiles | None:
        """The TLS files of ext_proc (None: plaintext); checked by
        :func:`services.picker.tls.check_tls_files` before serving."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_client_ca)
