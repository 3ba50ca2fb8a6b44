"""The Grafana dashboards of an llm-instance-gateway stack, as data: ``deploy/render.py`` writes
each as ``deploy/grafana/<uid>.json`` (import it in Grafana, or mount the Kubernetes ConfigMap
``lig-dashboards``), and ``tests/test_monitoring.py`` checks that every metric and label a panel
names is exported by a service of a running ``lig up`` stack.

Every dashboard takes its Prometheus data source from the variable ``datasource``. Series carry
``instance`` (the scraped service, added by Prometheus); the picker's per-pod series ``pod``, its
per-pool ones ``pool``; vLLM's own series come from scraping the model servers themselves.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Panel(msgspec.Struct, frozen=True):
    """One time-series (or table) panel: its queries as ``(legend, PromQL)`` pairs."""

    title: str
    queries: tuple[tuple[str, str], ...]
    unit: str = "short"
    description: str = ""
    table: bool = False  # an instant table of the latest values (label sets), not a graph


class Dashboard(msgspec.Struct, frozen=True):
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]


FLEET = Dashboard("lig-fleet", "lig: the fleet", "Per pool and pod: queues, KV cache, adapters "
                  "and how fresh the pickers' view of each pod is.", (
    Panel("Waiting requests per pod", (("{{instance}}", "sum by (instance) "
                                        "(vllm:num_requests_waiting)"),),
          description="vLLM's queue: requests not yet scheduled (scraped from the pods)."),
    Panel("Running requests per pod", (("{{instance}}", "sum by (instance) "
                                        "(vllm:num_requests_running)"),)),
    Panel("KV-cache use per pod", (("{{instance}}", "max by (instance) "
                                    "(vllm:kv_cache_usage_perc)"),), unit="percentunit"),
    Panel("LoRA adapters per pod", (("", "max by (instance, running_lora_adapters, "
                                         "waiting_lora_adapters, max_lora) "
                                         "(vllm:lora_requests_info)"),), table=True,
          description="The adapters each pod runs and waits for (vLLM's lora_requests_info)."),
    Panel("Metrics age per pod, as pickers see it", (
        ("{{pod}}", "max by (pod) (lig_picker_snapshot_age_seconds)"),), unit="s",
          description="Age of the newest snapshot of each pod; past --stale-after (1 s) the "
                      "picker treats the pod as stale."),
    Panel("Pods by freshness per pool", (
        ("{{pool}} {{state}}", "max by (pool, state) (lig_picker_pool_pods)"),)),
))

PICKERS = Dashboard("lig-pickers", "lig: pickers", "Decisions, their latency and outcome, the "
                    "load estimate, gray pods, prefix reuse, the decision stream and HTTP/2.", (
    Panel("Requests by outcome", (("{{outcome}}", "sum by (outcome) "
                                   "(rate(lig_picker_requests_total[1m]))"),), unit="reqps",
          description="routed, or the error the picker answered (429: shed)."),
    Panel("Requests routed per pod", (("{{pod}}", "sum by (pod) (rate(lig_picker_requests_total"
                                       "{outcome=\"routed\"}[1m]))"),), unit="reqps"),
    Panel("Decision latency", (
        ("p50", "histogram_quantile(0.5, sum by (le) (rate(lig_picker_decision_seconds_bucket"
                "[1m])))"),
        ("p99", "histogram_quantile(0.99, sum by (le) (rate(lig_picker_decision_seconds_bucket"
                "[1m])))"),), unit="s"),
    Panel("Load estimate per pod", (
        ("{{pod}} {{kind}}", "sum by (pod, kind) (lig_picker_load_estimate_requests)"),),
          description="Requests in flight (own, peers') and routed since the pod's newest "
                      "snapshot (unreported)."),
    Panel("Gray exclusions", (("{{pod}} {{reason}}", "sum by (pod, reason) "
                               "(rate(lig_picker_gray_exclusions_total[5m])) or on() vector(0)"),),
          unit="ops", description="0 while no pod was left out (a counter has no series "
                                  "before its first exclusion)."),
    Panel("Prefix reuse: predicted vs observed tokens", (
        ("predicted", "sum(rate(lig_picker_reused_tokens_predicted_total[5m]))"),
        ("observed", "sum(rate(lig_picker_reused_tokens_observed_total[5m]))"),),
          description="Prompt tokens the picker expected the chosen pod to have cached, against "
                      "what the model server reported (cached_tokens)."),
    Panel("Decision stream", (
        ("published", "sum(rate(lig_picker_decision_events_published_total[1m]))"),
        ("applied from peers", "sum(rate(lig_picker_decision_events_applied_total[1m]))"),
        ("dropped {{reason}}", "sum by (reason) "
                               "(rate(lig_picker_decision_events_dropped_total[1m]))"),),
          unit="ops"),
    Panel("Peers and readiness", (
        ("peers seen by {{instance}}", "max by (instance) (lig_picker_decision_peers)"),
        ("ready pickers", "sum(lig_picker_ready)"),
        ("pickers on NATS", "sum(lig_picker_nats_connected)"),)),
    Panel("Precise prefix index", (
        ("blocks {{pool}}", "max by (pool) (lig_picker_precise_blocks)"),
        ("incomplete pods {{pool}}", "max by (pool) (lig_picker_precise_incomplete_pods)"),)),
    Panel("HTTP/2 protocol errors", (("{{kind}}", "sum by (kind) "
                                      "(rate(lig_picker_http2_errors_total[5m])) "
                                      "or on() vector(0)"),),
          unit="ops", description="0 while there were none."),
))

PIPELINE = Dashboard("lig-pipeline", "lig: collectors, KV events and registry", "What feeds "
                     "the pickers: pod scrapes, the KV-event bridge and the registry.", (
    Panel("Scrapes by outcome", (("{{outcome}}", "sum by (outcome) "
                                  "(rate(lig_collector_scrapes_total[1m]))"),), unit="ops"),
    Panel("Scrape latency", (
        ("p99", "histogram_quantile(0.99, sum by (le) "
                "(rate(lig_collector_scrape_duration_seconds_bucket[1m])))"),), unit="s"),
    Panel("Pods per collector", (
        ("owned by {{instance}}", "max by (instance) (lig_collector_pods_owned)"),
        ("known", "max(lig_collector_pods_known)"),
        ("live collectors", "max(lig_collector_live_collectors)"),)),
    Panel("KV-event batches", (("{{outcome}}", "sum by (outcome) "
                                "(rate(lig_kv_events_batches_total[1m]))"),), unit="ops"),
    Panel("KV-event resyncs and publish errors", (
        ("resyncs", "sum(increase(lig_kv_events_resyncs_total[5m]))"),
        ("publish errors", "sum(increase(lig_kv_events_publish_errors_total[5m]))"),
        ("buffered while NATS away", "sum(lig_kv_events_buffered_messages)"),)),
    Panel("JetStream copies per stream", (
        ("{{stream}} {{state}}", "max by (stream, state) (lig_collector_stream_replicas)"),),
          description="Configured (--nats-replicas) and current copies of the registry's "
                      "bucket and the recording streams; fewer current than configured: a NATS "
                      "node is down or behind."),
    Panel("Registry", (
        ("reloads {{outcome}}", "sum by (outcome) (increase(lig_registry_reloads_total[5m]))"),
        ("refused {{reason}}", "sum by (reason) (increase(lig_registry_refused_total[5m]))"),
        ("input valid", "min(lig_registry_input_valid)"),)),
))

DASHBOARDS = (FLEET, PICKERS, PIPELINE)


def grafana_json(dashboard: Dashboard) -> dict[str, Any]:
    """``dashboard`` in Grafana's JSON model (schema 39), two panels a row."""
    panels = []
    for number, panel in enumerate(dashboard.panels):
        targets = [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    **({"instant": True, "format": "table"} if panel.table else {})}
                   for i, (legend, expr) in enumerate(panel.queries)]
        panels.append({
            "id": number + 1, "type": "table" if panel.table else "timeseries",
            "title": panel.title, "description": panel.description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (number % 2), "y": 8 * (number // 2)},
            "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
            "targets": targets,
        })
    return {
        "uid": dashboard.uid, "title": dashboard.title, "description": dashboard.description,
        "tags": ["lig"], "schemaVersion": 39, "editable": True, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource",
                                 "query": "prometheus", "label": "Prometheus"}]},
        "panels": panels,
    }


def queries() -> list[str]:
    """Every PromQL expression of every dashboard (for the test)."""
    return [expr for dashboard in DASHBOARDS for panel in dashboard.panels
            for _, expr in panel.queries]


def panels() -> dict[str, list[str]]:
    """Each panel (``dashboard uid / title``) and its PromQL expressions (for the test)."""
    return {f"{dashboard.uid} / {panel.title}": [expr for _, expr in panel.queries]
            for dashboard in DASHBOARDS for panel in dashboard.panels}
