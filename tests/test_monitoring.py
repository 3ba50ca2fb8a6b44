"""The shipped dashboards and alerting rules match what the services export, and fire.

Every metric and label that a Grafana panel (``monitoring/dashboards.py``) or an alerting rule
(``monitoring/lig-rules.yaml``) names must be exported by a service, or by a simulated
vLLM pod, of a running ``lig up`` stack: the stack is scraped while requests are in flight. The
rules pass ``promtool check rules`` and every alert fires in ``promtool test rules`` (Debian's
``prometheus`` package; ``make test`` installs it when missing). ``lig up --observe`` runs a real
Prometheus with those rules, and an alert fires when the pods' metrics stop.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import signal
import subprocess
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterable
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, Metric
from prometheus_client.parser import text_string_to_metric_families

from lig.topology import StackInfo
from monitoring import dashboards
from tests.support.lig_up import lig_up
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "deploy" / "prometheus" / "lig-rules.yaml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "lig-rules.test.yaml"
REFERENCE = runpy.run_path(str(REPO / "docs" / "render_reference.py"))

# A metric name in PromQL: ours and vLLM's (which has colons).
_METRIC = re.compile(r"\b(lig_[a-z0-9_]+|vllm:[a-z0-9_:]+)")
# Labels a query names: in a selector's matchers, and in by (...) / without (...).
_MATCHERS = re.compile(r"\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
# Labels Prometheus adds (instance, job) or a function reads (le, of histogram buckets).
_ALWAYS = {"instance", "job", "le"}
_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path is not None, ("promtool is missing: install Debian's prometheus package "
                              "(apt-get install prometheus; `make test` does when run as root)")
    return path


def test_the_rules_are_valid_and_every_alert_fires_in_its_unit_test() -> None:
    check = subprocess.run([_promtool(), "check", "rules", str(RULES)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    run = subprocess.run([_promtool(), "test", "rules", str(RULE_TESTS)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    alerts = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"]
              for rule in group["rules"] if "alert" in rule}
    fired = {case["alertname"] for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
             for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert alerts == fired, f"alerts without a test that fires them: {alerts - fired}"


def _queries() -> list[str]:
    rules = [rule["expr"] for group in yaml.safe_load(RULES.read_text())["groups"]
             for rule in group["rules"]]
    return rules + dashboards.queries()


def _family(name: str, exported: dict[str, set[str]]) -> str | None:
    """The exported family a PromQL metric name belongs to (a counter's ``_total``, a
    histogram's ``_bucket``...), or None."""
    if name in exported:
        return name
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and name[:-len(suffix)] in exported:
            return name[:-len(suffix)]
    return None


def _declared_labels() -> dict[str, set[str]]:
    """The label names every lig metric is declared with, from the services' own registries
    (a labelled metric exports no sample until its first event: a gray pod, a dropped
    decision)."""
    declared: dict[str, set[str]] = {}
    for make_registry in REFERENCE["_metric_registries"]().values():
        registry: CollectorRegistry = make_registry()
        # prometheus_client has no public way to list a registry's collectors or their labels.
        for collector in list(registry._collector_to_names):
            names = getattr(collector, "_labelnames", None)
            families: Iterable[Metric] = collector.collect()
            for family in families:
                declared.setdefault(family.name, set()).update(names or ())
                for sample in family.samples:
                    declared[family.name].update(sample.labels)
    return declared


def _scrape(urls: Iterable[str]) -> dict[str, set[str]]:
    """Family name -> every label name its samples carry, over every endpoint."""
    exported: dict[str, set[str]] = {}
    for url in urls:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            labels = exported.setdefault(family.name, set())
            for sample in family.samples:
                labels.update(sample.labels)
    return exported


def test_every_metric_and_label_the_dashboards_and_rules_name_is_exported(
        tmp_path: Path) -> None:
    with lig_up(tmp_path / "state") as stack:
        info = StackInfo.read(tmp_path / "state")
        assert info is not None and info.metrics, "lig up lists no metrics endpoints"
        assert {"registry", "collector", "kv-events", "picker-0", "picker-1"} <= set(info.metrics)
        stop = threading.Event()  # requests in flight while the stack is scraped
        clients = [threading.Thread(target=_load, args=(stack.gateway, stop)) for _ in range(4)]
        for client in clients:
            client.start()
        try:
            with httpx.Client(base_url=stack.gateway, timeout=30) as client:
                assert client.post("/v1/completions", json={
                    "model": "tweet-summary", "prompt": "hi", "max_tokens": 4}).status_code == 200
            exported = _scrape(info.metrics.values())
        finally:
            stop.set()
            for client in clients:
                client.join(60)
    declared = _declared_labels()
    problems = []
    for query in _queries():
        families = {name: _family(name, exported) for name in _METRIC.findall(query)}
        problems += [f"{query!r}: {name} is not exported" for name, family in families.items()
                     if family is None]
        labels = set().union(*(exported[f] | declared.get(f, set())
                               for f in families.values() if f is not None), _ALWAYS)
        named = {label for matchers in _MATCHERS.findall(query)
                 for label in _MATCHER_LABEL.findall(matchers)}
        named |= {label.strip() for group in _GROUPING.findall(query)
                  for label in group.split(",") if label.strip()}
        problems += [f"{query!r}: no metric of it has the label {label!r}"
                     for label in sorted(named - labels)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("uid", ["lig-fleet", "lig-pickers", "lig-pipeline"])
def test_each_dashboard_is_rendered_and_takes_its_data_source_from_a_variable(uid: str) -> None:
    dashboard = json.loads((REPO / "deploy" / "grafana" / f"{uid}.json").read_text())
    assert dashboard["uid"] == uid and dashboard["panels"]
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource"}
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])


def _load(gateway: str, stop: threading.Event) -> None:
    """Completions of the base model and an adapter through ``gateway`` until ``stop``."""
    with httpx.Client(base_url=gateway, timeout=30) as client:
        while not stop.is_set():
            for model in ("tweet-summary", "meta-llama/Llama-3.1-8B-Instruct"):
                client.post("/v1/completions", json={
                    "model": model, "prompt": "Say hello", "max_tokens": 64})


def _empty_panels(prometheus: str) -> list[str]:
    """The dashboard panels none of whose queries returns a series now."""
    empty = []
    for panel, expressions in dashboards.panels().items():
        found = 0
        for expression in expressions:
            url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
            with urllib.request.urlopen(url, timeout=5) as response:
                found += len(json.loads(response.read())["data"]["result"])
        if not found:
            empty.append(panel)
    return empty


def _firing(prometheus: str) -> set[str]:
    """The names of the alerts firing now in the Prometheus at ``prometheus``."""
    with urllib.request.urlopen(f"{prometheus}/api/v1/alerts", timeout=5) as response:
        alerts = json.loads(response.read())["data"]["alerts"]
    return {alert["labels"]["alertname"] for alert in alerts if alert["state"] == "firing"}


def test_lig_up_observe_fires_an_alert_when_the_pods_metrics_stop(tmp_path: Path) -> None:
    with lig_up(tmp_path / "state", "--observe") as stack:
        info = stack.info
        assert info.prometheus, "lig up --observe names no Prometheus"

        def scraped() -> set[str]:  # the services whose last scrape succeeded
            with urllib.request.urlopen(f"{info.prometheus}/api/v1/targets",
                                        timeout=5) as response:
                targets = json.loads(response.read())["data"]["activeTargets"]
            return {t["labels"]["service"] for t in targets if t["health"] == "up"}

        wait_until(lambda: scraped() == set(info.metrics), within=30,
                   what="Prometheus scraping every service and pod of the stack")
        # Under load, every panel of every dashboard shows data (a rate needs two scrapes).
        stop = threading.Event()
        clients = [threading.Thread(target=_load, args=(stack.gateway, stop)) for _ in range(4)]
        for client in clients:
            client.start()
        try:
            wait_until(lambda: not _empty_panels(info.prometheus), within=60,
                       what="every dashboard panel with data")
        finally:
            stop.set()
            for client in clients:
                client.join(60)
        assert _firing(info.prometheus) == set()
        sim = next(pid for pid in stack.child_pids()
                   if b"\0sim\0" in Path(f"/proc/{pid}/cmdline").read_bytes())
        os.kill(sim, signal.SIGSTOP)  # every pod's /metrics stops answering
        try:
            # Stale after 3 s (the test stack's timing), then the rule's `for: 30s`.
            wait_until(lambda: "LigPoolWithoutFreshPods" in _firing(info.prometheus),
                       within=120, what="LigPoolWithoutFreshPods firing")
        finally:
            os.kill(sim, signal.SIGCONT)
