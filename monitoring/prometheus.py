"""The Prometheus that ``lig up --observe`` runs beside the stack: its configuration (every
service's and simulated pod's metrics endpoint, the shipped alerting rules) and its command.

The binary is Debian's ``prometheus`` package (``/usr/bin/prometheus``, on PATH), or any
Prometheus 2.x named by ``--prometheus``; nothing is downloaded.
"""

from __future__ import annotations

import importlib.resources
import shutil
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from shared.errors import ConfigError

RULES_FILE = "lig-rules.yaml"
SCRAPE_INTERVAL = "2s"  # a laptop stack: alerts show within seconds of their `for`


def rules_text() -> str:
    """The shipped alerting rules (package data: works from a wheel too)."""
    return importlib.resources.files(__package__).joinpath(RULES_FILE).read_text()


def config(targets: Mapping[str, str], rules_path: Path) -> str:
    """``prometheus.yml`` scraping every ``name -> metrics URL`` of ``targets`` (the label
    ``service`` names each; ``instance`` stays host:port) with the rules at ``rules_path``."""
    static = [{"targets": [urlsplit(url).netloc], "labels": {"service": name}}
              for name, url in sorted(targets.items())]
    document = {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": [str(rules_path)],
        "scrape_configs": [{"job_name": "lig", "static_configs": static}],
    }
    return yaml.safe_dump(document, sort_keys=False)


def binary(name: str = "prometheus") -> str:
    """The Prometheus executable ``name`` (a path, or a command on PATH)."""
    found = shutil.which(name)
    if found is None:
        raise ConfigError(f"--observe needs Prometheus: {name!r} is not on PATH; install "
                          "Debian's prometheus package (apt-get install prometheus) or name the "
                          "binary with --prometheus")
    return found


def command(executable: str, config_path: Path, data_dir: Path, address: str) -> list[str]:
    """The argv of a Prometheus serving its UI and API on ``address`` (host:port)."""
    return [executable, f"--config.file={config_path}", f"--storage.tsdb.path={data_dir}",
            f"--web.listen-address={address}", "--storage.tsdb.retention.time=1d",
            "--log.level=warn"]
