"""The picker's Prometheus metrics (served on ``--metrics-port``, 9090 by default).

Per-request updates go through cached label children (no label lookup on the hot path); gauges
about pods and NATS are refreshed by the service's housekeeping loop, not per request. With
``--workers N`` the values live in prometheus-client's multiprocess files and the supervisor
serves the sum (counters) or the live maximum (gauges that every worker sees alike).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from scheduling.precise_index import PreciseIndex
from scheduling.prefix_index import PrefixIndex
from services.picker.responses import Usage
from services.picker.state import Freshness, PodTable

# A decision usually takes tens of microseconds; the tail matters up to Envoy's message timeout.
_DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                     0.05, 0.1, 0.25, 1.0)
UNREGISTERED = "unregistered"


class PickerMetrics:
    """Every metric the picker exports, registered on the ``prometheus`` collector registry."""

    def __init__(self, prometheus: CollectorRegistry) -> None:
        self.requests = Counter(
            "lig_picker_requests", "Requests handled, by requested model, target model, pod "
            "and outcome (routed, 400, 404, 429, 503, 500)",
            ["model", "target_model", "pod", "outcome"], registry=prometheus)
        self.decision_seconds = Histogram(
            "lig_picker_decision_seconds", "Time from a complete request body to the routing "
            "answer", buckets=_DECISION_BUCKETS, registry=prometheus)
        self.tokens = Counter(
            "lig_picker_tokens", "Tokens reported in response usage, by requested model and "
            "kind, of the responses the picker reads (--record-responses, FULL_DUPLEX_STREAMED)",
            ["model", "kind"], registry=prometheus)
        self.all_stale = Counter(
            "lig_picker_all_stale_decisions", "Requests routed uniformly at random because no "
            "pod had fresh metrics", registry=prometheus)
        self.undecodable = Counter(
            "lig_picker_undecodable_messages", "NATS messages that did not decode and were "
            "skipped, by source", ["source"], registry=prometheus)
        self.out_of_order = Counter(
            "lig_picker_out_of_order_snapshots", "Metric snapshots dropped because a newer one "
            "had already arrived", registry=prometheus)
        self.snapshots = Counter(
            "lig_picker_snapshots_received", "Metric snapshots received from NATS, before any "
            "check (the ingest rate)", registry=prometheus)
        self.wrong_address = Counter(
            "lig_picker_wrong_address_snapshots", "Metric snapshots dropped because their "
            "address is not the registered endpoint's", registry=prometheus)
        self.pods = Gauge(
            "lig_picker_pods", "Member pods of the served pools by metrics freshness",
            ["state"], registry=prometheus, multiprocess_mode="livemax")
        self.pool_pods = Gauge(
            "lig_picker_pool_pods", "Member pods of each served pool by metrics freshness",
            ["pool", "state"], registry=prometheus, multiprocess_mode="livemax")
        self.model_conflicts = Gauge(
            "lig_picker_model_conflicts", "Model names registered in more than one of the "
            "pools this picker serves (each keeps its previous pool, or none)",
            registry=prometheus, multiprocess_mode="livemax")
        self.snapshot_age = Gauge(
            "lig_picker_snapshot_age_seconds", "Age of each pod's newest metric snapshot "
            "(scrape time to now)", ["pod"], registry=prometheus, multiprocess_mode="livemax")
        self.in_flight = Gauge(
            "lig_picker_in_flight_requests", "Requests this picker sent to each pod that have "
            "not finished", ["pod"], registry=prometheus, multiprocess_mode="livesum")
        self.gray_exclusions = Counter(
            "lig_picker_gray_exclusions", "Times a pod was left out as gray, by pod and reason "
            "(unfinished: requests not finishing while it reports idle; 5xx: mostly failed "
            "responses)", ["pod", "reason"], registry=prometheus)
        self.nats_connected = Gauge(
            "lig_picker_nats_connected", "1 while connected to NATS", registry=prometheus,
            multiprocess_mode="livemin")
        self.http2_errors = Counter(
            "lig_picker_http2_errors", "Connections the built-in ext_proc server closed for a "
            "protocol error, by kind (an HTTP/2 error code name, or PREFACE_TIMEOUT)", ["kind"],
            registry=prometheus)
        self.served_elsewhere = Counter(
            "lig_picker_served_elsewhere", "Requests the gateway reports as served by another "
            "pod than the picker's primary choice (it went down the fallback list); they are "
            "accounted to the pod that served them", registry=prometheus)
        self.ready = Gauge(
            "lig_picker_ready", "1 once registry state and a metric snapshot have arrived",
            registry=prometheus, multiprocess_mode="livemin")
        self.decisions_published = Counter(
            "lig_picker_decision_events_published", "Decisions (routed, finished, shed) this "
            "picker published on the decision stream", registry=prometheus)
        self.decisions_dropped = Counter(
            "lig_picker_decision_events_dropped", "Decisions not published, by reason "
            "(queue_full: more pending than the queue holds; nats_away: NATS disconnected)",
            ["reason"], registry=prometheus)
        self.records_published = Counter(
            "lig_picker_decision_records_published", "Decision and outcome records this picker "
            "published for the flight recorder (<prefix>.records.<pool>)", registry=prometheus)
        self.records_dropped = Counter(
            "lig_picker_decision_records_dropped", "Decision and outcome records not published, "
            "by reason (queue_full, nats_away, too_large: one record beyond NATS's max_payload)",
            ["reason"], registry=prometheus)
        self.decisions_applied = Counter(
            "lig_picker_decision_events_applied", "Peer pickers' decisions applied to the load "
            "estimate (this picker's own, echoed back, are not counted)", registry=prometheus)
        self.decisions_expired = Counter(
            "lig_picker_decision_requests_expired", "Peers' requests dropped from the in-flight "
            "counts without a finished event (peer silent, or request past its TTL)",
            registry=prometheus)
        self.decision_peers = Gauge(
            "lig_picker_decision_peers", "Peer pickers heard from on the decision stream "
            "within their heartbeat allowance", registry=prometheus, multiprocess_mode="livemax")
        self.load_estimate = LoadEstimateCollector()
        prometheus.register(self.load_estimate)
        self.kv_blocks_skipped = Counter(
            "lig_picker_kv_blocks_skipped", "KV block-change messages from NATS skipped, by "
            "reason (undecodable, pool: not served, address: the pod is registered elsewhere, "
            "unknown: the pod is not a member)",
            ["reason"], registry=prometheus)
        self.precise = PreciseIndexCollector()
        prometheus.register(self.precise)
        self.prefix = PrefixIndexCollector()
        prometheus.register(self.prefix)
        # Prefix-cache reuse, predicted and observed over the same requests (those whose
        # response reported cached_tokens), so that their ratio tells how right the prefix
        # index is (docs/scheduling.md, "Is the prefix index right?").
        self.reused_predicted = Counter(
            "lig_picker_reused_tokens_predicted", "Prompt tokens the prefix index expected the "
            "serving pod to have cached, over the requests whose response reported cached "
            "tokens, by pool", ["pool"], registry=prometheus)
        self.reused_observed = Counter(
            "lig_picker_reused_tokens_observed", "Prompt tokens the serving pod reported "
            "cached (usage.prompt_tokens_details.cached_tokens; vLLM: "
            "--enable-prompt-tokens-details), by pool", ["pool"], registry=prometheus)
        self.reused_reports = Counter(
            "lig_picker_reused_tokens_reports", "Responses that reported cached tokens (the "
            "requests both reused-token counters count), by pool", ["pool"],
            registry=prometheus)
        self._request_children: dict[tuple[str, str, str, str], Counter] = {}
        self._token_children: dict[str, tuple[Counter, Counter]] = {}
        self._reuse_children: dict[str, tuple[Counter, Counter, Counter]] = {}
        self._pods_seen: set[str] = set()

    def count_request(self, model: str, target_model: str, registered: bool, pod: str,
                      outcome: str) -> None:
        """Count one request's outcome; unregistered names share one label value."""
        if not registered:
            model = target_model = UNREGISTERED if model else ""
        key = (model, target_model, pod, outcome)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(*key)
        child.inc()

    def count_served_elsewhere(self) -> None:
        """Count one request a gateway served from a fallback endpoint."""
        self.served_elsewhere.inc()

    def count_http2_error(self, kind: str) -> None:
        """Count one connection closed by the built-in HTTP/2 server for a protocol error."""
        self.http2_errors.labels(kind).inc()

    def count_tokens(self, model: str, registered: bool, usage: Usage) -> None:
        """Add a response's token usage."""
        name = model if registered else UNREGISTERED
        children = self._token_children.get(name)
        if children is None:
            children = self._token_children[name] = (
                self.tokens.labels(name, "prompt"), self.tokens.labels(name, "completion"))
        children[0].inc(usage.prompt_tokens)
        children[1].inc(usage.completion_tokens)

    def count_reuse(self, pool: str, predicted: int, observed: int) -> None:
        """Add one response's reported cached tokens and the picker's prediction for it."""
        children = self._reuse_children.get(pool)
        if children is None:
            children = self._reuse_children[pool] = (
                self.reused_predicted.labels(pool), self.reused_observed.labels(pool),
                self.reused_reports.labels(pool))
        children[0].inc(predicted)
        children[1].inc(observed)
        children[2].inc()

    def show_pods(self, pools: dict[str, Freshness], in_flight: dict[str, int]) -> None:
        """Refresh the per-pool and per-pod gauges (members leave no stale label behind)."""
        ages: dict[str, float] = {}
        for pool, freshness in pools.items():
            self.pool_pods.labels(pool, "fresh").set(freshness.fresh)
            self.pool_pods.labels(pool, "stale").set(freshness.stale)
            ages.update(freshness.ages)
        self.pods.labels("fresh").set(sum(f.fresh for f in pools.values()))
        self.pods.labels("stale").set(sum(f.stale for f in pools.values()))
        for pod, age in ages.items():
            self.snapshot_age.labels(pod).set(age if math.isfinite(age) else float("nan"))
            self.in_flight.labels(pod).set(in_flight.get(pod, 0))
        for gone in self._pods_seen - ages.keys():
            self.snapshot_age.remove(gone)
            self.in_flight.remove(gone)
        self._pods_seen = set(ages)


class LoadEstimateCollector(Collector):
    """``lig_picker_load_estimate_requests{pool,pod,kind}``, read from the pod tables when
    scraped (so it is current to the millisecond, unlike the housekeeping gauges): per pod, the
    requests in flight from this picker (``in_flight_own``) and from its peers
    (``in_flight_peers``), and those routed since the pod's newest snapshot by any of them
    (``unreported``). ``tables`` gives the pod table of each served pool (set once the gateway
    exists). Served by a single-process picker (``--workers 1``)."""

    def __init__(self) -> None:
        self.tables: Callable[[], dict[str, PodTable]] = dict

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """One sample per pool, pod and kind with a count (zeros are left out)."""
        family = GaugeMetricFamily(
            "lig_picker_load_estimate_requests", "The picker's load estimate per pod: "
            "requests in flight (own, peers') and routed since the pod's newest snapshot "
            "(unreported)", labels=["pool", "pod", "kind"])
        for pool, table in list(self.tables().items()):
            for kind, counts in (("in_flight_own", table.in_flight()),
                                 ("in_flight_peers", table.peer_in_flight()),
                                 ("unreported", table.unreported())):
                for pod, count in counts.items():
                    family.add_metric([pool, pod, kind], count)
        yield family


class PreciseIndexCollector(Collector):
    """The precise prefix indexes (``scheduling/precise_index.py``), read when scraped (their
    hot paths touch no Prometheus object): per pool, ``lig_picker_precise_blocks`` held,
    ``..._speculative_blocks``, ``..._event_pods`` (pods publishing events), and the counters
    ``..._messages`` applied, ``..._blocks_stored``, ``..._blocks_reannounced`` (a block
    announced again as it was: vLLM's full report mode), ``..._blocks_removed``,
    ``..._blocks_evicted`` (the bound), ``..._blocks_skipped{reason}``, ``..._clears`` (ranks
    cleared), ``..._resyncs``, ``..._gaps`` (messages lost on the way), ``..._blocks_recovered``
    and the gauge ``..._incomplete_pods``. ``indexes`` gives each served pool's index (set once the
    gateway exists). Served by a single-process picker (``--workers 1``)."""

    def __init__(self) -> None:
        self.indexes: Callable[[], dict[str, PreciseIndex]] = dict

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """One sample per pool (and reason)."""
        prefix = "lig_picker_precise"
        gauges = {name: GaugeMetricFamily(f"{prefix}_{name}", text, labels=["pool"])
                  for name, text in (
                      ("blocks", "Blocks the precise prefix index holds"),
                      ("speculative_blocks", "Speculative blocks the precise prefix index "
                                             "holds"),
                      ("event_pods", "Pods whose KV-cache events reached the precise index"),
                      ("incomplete_pods", "Pods whose precise index state is incomplete (KV "
                                          "block changes lost, a resync): also scored from the "
                                          "approximate index"))}
        counters = {name: CounterMetricFamily(f"{prefix}_{name}", text, labels=["pool"])
                    for name, text in (
                        ("messages", "KV block-change messages applied"),
                        ("blocks_stored", "Blocks filed from BlockStored events"),
                        ("blocks_reannounced", "Blocks a BlockStored announced again as the "
                                               "index held them (vLLM's full report mode)"),
                        ("blocks_removed", "Blocks removed by BlockRemoved events"),
                        ("blocks_evicted", "Blocks dropped to keep the index's bound"),
                        ("clears", "Ranks cleared (AllBlocksCleared, resync markers)"),
                        ("resyncs", "Resync markers received"),
                        ("gaps", "KV block-change messages lost on the way (gaps in lig "
                                 "kv-events' numbering)"),
                        ("blocks_recovered", "Blocks filed after a clear because their parent "
                                             "was known from before it"))}
        skipped = CounterMetricFamily(f"{prefix}_blocks_skipped", "Blocks of BlockStored "
                                      "events not filed, by reason", labels=["pool", "reason"])
        for pool, index in list(self.indexes().items()):
            stats = index.stats
            for name, value in (("blocks", len(index)),
                                ("speculative_blocks", index.speculative_blocks),
                                ("event_pods", len(index.event_pods())),
                                ("incomplete_pods", len(index.incomplete_pods()))):
                gauges[name].add_metric([pool], value)
            for name, value in (("messages", stats.messages), ("blocks_stored", stats.stored),
                                ("blocks_reannounced", stats.reannounced),
                                ("blocks_removed", stats.removed),
                                ("blocks_evicted", stats.evicted), ("clears", stats.cleared),
                                ("resyncs", stats.resyncs), ("gaps", stats.gaps),
                                ("blocks_recovered", stats.recovered)):
                counters[name].add_metric([pool], value)
            for reason, count in stats.skipped.items():
                skipped.add_metric([pool, reason], count)
        yield from gauges.values()
        yield from counters.values()
        yield skipped


class PrefixIndexCollector(Collector):
    """``lig_picker_prefix_index_entries{pool}``: the block hashes each served pool's approximate
    prefix index (``scheduling/prefix_index.py``) holds, read when scraped (its hot path touches
    no Prometheus object), so that a soak can see it fill up to ``--prefix-index-entries`` and
    stay there. ``indexes`` gives each served pool's index (set once the gateway exists). Served
    by a single-process picker (``--workers 1``)."""

    def __init__(self) -> None:
        self.indexes: Callable[[], dict[str, PrefixIndex]] = dict

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """One sample per pool."""
        family = GaugeMetricFamily(
            "lig_picker_prefix_index_entries", "Block hashes the approximate prefix index "
            "holds (at most --prefix-index-entries)", labels=["pool"])
        for pool, index in list(self.indexes().items()):
            family.add_metric([pool], len(index))
        yield family
