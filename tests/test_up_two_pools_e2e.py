"""``lig up --config examples/two-pools`` as a user runs it: two simulated pools with different
base models behind one gateway; each model served by its own pool, ``/v1/models`` listing both,
``lig status`` showing both pools' pods. The example's ports are moved to free ones first (the
example lists 8000-8001 and 8010-8011)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lig.status import PICKER_REQUESTS_FAMILY
from lig.topology import EXAMPLE_CONFIG, StackInfo, free_ports
from tests.support.lig_up import REPO, STATUS_STALE_AFTER, lig_up
from tests.support.ports import LEASES

pytestmark = pytest.mark.timeout(90)

EXAMPLE = EXAMPLE_CONFIG.parent / "two-pools"
MODELS = {"meta-llama/Llama-3.1-8B-Instruct": "llama-8b", "sql-lora": "llama-8b",
          "Qwen/Qwen2.5-32B-Instruct": "qwen-32b", "qwen-poet": "qwen-32b"}
POD_PREFIX = {"llama-8b": "llama-", "qwen-32b": "qwen-"}


def _example_on_free_ports(folder: Path) -> Path:
    text = (EXAMPLE / "pools.yaml").read_text()
    for first in (8000, 8010):
        base = free_ports(LEASES, pickers=0, pods=2, gateway=0).sim_base
        for offset in range(2):
            text = text.replace(f"port: {first + offset}}}", f"port: {base + offset}}}")
    folder.mkdir()
    (folder / "pools.yaml").write_text(text)
    return folder


def test_lig_up_serves_both_pools_at_one_address(tmp_path: Path) -> None:
    config = _example_on_free_ports(tmp_path / "two-pools")
    state = tmp_path / "state"
    with lig_up(state, "--config", str(config), ready_within=60) as stack:
        output = stack.output()
        # the summary names both simulated pools
        assert "sim-llama-8b" in output and "sim-qwen-32b" in output
        with httpx.Client(base_url=stack.gateway, timeout=10) as client:
            for model in MODELS:
                for _ in range(5):
                    response = client.post("/v1/completions", json={
                        "model": model, "prompt": "hi", "max_tokens": 2})
                    assert response.status_code == 200, (model, response.text)
                    assert response.json()["model"] == model
            listing = client.get("/v1/models").json()
            assert {(m["id"], m["owned_by"]) for m in listing["data"]} == set(MODELS.items())
        info = StackInfo.read(state)
        assert info is not None and info.pools == ["llama-8b", "qwen-32b"]
        for url in info.picker_metrics:
            page = httpx.get(url, timeout=5).text
            for family in text_string_to_metric_families(page):
                if family.name != PICKER_REQUESTS_FAMILY:
                    continue
                for sample in family.samples:
                    model, pod = sample.labels.get("model"), sample.labels.get("pod", "")
                    if model in MODELS and sample.name.endswith("_total") and sample.value:
                        assert pod.startswith(POD_PREFIX[MODELS[model]]), sample
        # Freshness judged as the stack's pickers judge it (lig_up's test timing), and asked
        # again while not every pod is fresh: a scrape that failed shows a pod as failing
        # until the next one (the single reading failed on a loaded machine's late scrape).
        deadline = time.monotonic() + 15
        while True:
            status = subprocess.run(
                [sys.executable, "-m", "lig.cli", "status", "--state-dir", str(state), "--json",
                 *STATUS_STALE_AFTER], capture_output=True, text=True, timeout=30, cwd=REPO)
            report = json.loads(status.stdout)
            if status.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert {(row["pool"], row["pod"]) for row in report["pods"]} == {
            ("llama-8b", "llama-0"), ("llama-8b", "llama-1"),
            ("qwen-32b", "qwen-0"), ("qwen-32b", "qwen-1")}
        assert {(row["pool"], row["fresh"], tuple(row["models"])) for row in report["pools"]} == {
            ("llama-8b", 2, ("meta-llama/Llama-3.1-8B-Instruct", "sql-lora")),
            ("qwen-32b", 2, ("Qwen/Qwen2.5-32B-Instruct", "qwen-poet"))}
