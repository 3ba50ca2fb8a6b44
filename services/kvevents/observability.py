"""The Prometheus metrics of ``lig kv-events``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

PODS_GAUGE = "lig_kv_events_pods"
FOLLOWED_GAUGE = "lig_kv_events_pods_followed"  # also read by `lig up`'s readiness check


class KVEventsMetrics:
    """This service's counters, in their own Prometheus registry."""

    def __init__(self) -> None:
        self.prometheus = CollectorRegistry()
        r = self.prometheus
        self.batches = Counter("lig_kv_events_batches", "Event batches by outcome: apply, "
                               "duplicate, gap, reset (engine restart), replayed, resync, "
                               "malformed, replay_malformed", ["outcome"], registry=r)
        self.skipped = Counter("lig_kv_events_skipped", "Malformed messages or events skipped, "
                               "by reason", ["reason"], registry=r)
        self.published = Counter("lig_kv_events_published", "Block-change messages published "
                                 "(markers included)", registry=r)
        self.resyncs = Counter("lig_kv_events_resyncs", "Resync markers published: events lost "
                               "beyond what replay could recover", registry=r)
        self.publish_errors = Counter("lig_kv_events_publish_errors", "Block-change messages "
                                      "that NATS did not take at once (held in the buffer, "
                                      "published once it is back)", registry=r)
        self.buffered = Gauge("lig_kv_events_buffered_messages", "Block-change messages held "
                              "until NATS takes them (markers included)", registry=r)
        self.buffered_bytes = Gauge("lig_kv_events_buffered_bytes", "Encoded bytes of the "
                                    "block-change messages held", registry=r)
        self.buffer_overflows = Counter("lig_kv_events_buffer_overflows", "Pod ranks whose "
                                        "held changes were replaced by a resync marker (the "
                                        "buffer's bound was reached)", registry=r)
        self.buffer_dropped = Counter("lig_kv_events_buffer_dropped", "Held block-change "
                                      "messages replaced by resync markers", registry=r)
        self.pods = Gauge(PODS_GAUGE, "Pods subscribed to", registry=r)
        self.followed = Gauge(FOLLOWED_GAUGE, "Pods whose events are followed: the events "
                              "connection is up and its replay done", registry=r)
        self.replicas = Gauge("lig_kv_events_replicas", "Replicas sharing the pods (this one "
                              "included), as its heartbeats tell", registry=r)
