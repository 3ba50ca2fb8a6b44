"""The collector's own Prometheus metrics, and the HTTP endpoint that serves them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

SCRAPE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
PARSE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)


class CollectorMetrics:
    """Counters and gauges of one collector, in their own Prometheus registry (no global state)."""

    def __init__(self) -> None:
        self.prometheus = CollectorRegistry()
        r = self.prometheus
        self.scrapes = Counter("lig_collector_scrapes", "Pod scrapes by outcome (ok, timeout, "
                               "connect_error, http_status, transport_error, too_large, bad_page)",
                               ["outcome"], registry=r)
        self.scrape_duration = Histogram(
            "lig_collector_scrape_duration_seconds",
            "Time from sending a scrape to having its snapshot (fetch and parse)",
            buckets=SCRAPE_BUCKETS, registry=r)
        self.parse_duration = Histogram("lig_collector_parse_duration_seconds",
                                        "Time to parse one metrics page",
                                        buckets=PARSE_BUCKETS, registry=r)
        self.published = Counter("lig_collector_snapshots_published",
                                 "Snapshots handed to NATS", registry=r)
        self.publish_errors = Counter(
            "lig_collector_publish_errors",
            "Snapshots not published: NATS disconnected (dropped) or the publish failed",
            ["reason"], registry=r)
        self.pods_known = Gauge("lig_collector_pods_known",
                                "Pods in the registry, over all pools", registry=r)
        self.pods_owned = Gauge("lig_collector_pods_owned",
                                "Pods this collector scrapes", registry=r)
        self.live_collectors = Gauge("lig_collector_live_collectors",
                                     "Collectors sharing the pods, this one included", registry=r)
        self.stream_replicas = Gauge(
            "lig_collector_stream_replicas",
            "Copies of each JetStream stream of the stack (the recording streams, the registry's "
            "bucket) by state: configured, and current (the leader and the replicas caught up)",
            ["stream", "state"], registry=r)
        self.undecodable = Counter("lig_collector_undecodable_messages",
                                   "Registry entries or heartbeats skipped as undecodable",
                                   ["source"], registry=r)
