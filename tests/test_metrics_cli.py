"""``lig metrics parse``: files, a real HTTP server on 127.0.0.1, and the failures operators hit."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from lig.cli import main
from shared.vllm_metrics import CACHE_CONFIG, LORA_INFO, RUNNING
from tests.support.ports import free_port

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"
V1_PAGE = FIXTURES / "vllm_v1.txt"
V1_JSON = {
    "waiting": 7,
    "running": 24,
    "kv_cache_usage": 0.4375,
    "running_adapters": ["sql-lora", "chat-lora"],
    "waiting_adapters": ["summarize-lora"],
    "max_lora": 4,
    "block_size": 16,
    "num_gpu_blocks": 27910,
    "missing": [],
}


class MetricsServer:
    """A real HTTP server on 127.0.0.1 serving fixed pages by path; /slow never answers."""

    def __init__(self, pages: dict[str, bytes]) -> None:
        self.release = threading.Event()
        server_pages, release = pages, self.release

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/slow":
                    release.wait(10)
                    return
                body = server_pages.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body or b"not found\n")

            def log_message(self, format: str, *args: object) -> None:
                pass  # keep test output clean

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def metrics_server() -> Iterator[MetricsServer]:
    server = MetricsServer(
        {
            "/metrics": V1_PAGE.read_bytes(),
            "/html": b"<html><body>Welcome to nginx!</body></html>\n",
        }
    )
    yield server
    server.close()


def run_lig(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["metrics", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_from_a_file(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_lig(capsys, "parse", str(V1_PAGE), "--json")
    assert (code, err) == (0, "")
    assert json.loads(out) == V1_JSON


def test_table_from_a_file(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_lig(capsys, "parse", str(FIXTURES / "vllm_v0.txt"))
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"what the gateway reads from {FIXTURES / 'vllm_v0.txt'}:"
    fields = dict(line.split(None, 1) for line in lines[1:9])
    assert fields == {
        "waiting": "2",
        "running": "9",
        "kv_cache_usage": "0.8125",
        "running_adapters": "(none)",
        "waiting_adapters": "(none)",
        "max_lora": "2",
        "block_size": "16",
        "num_gpu_blocks": "12850",
    }
    assert lines[9] == (
        "families found:   vllm:num_requests_waiting, vllm:num_requests_running, "
        "vllm:gpu_cache_usage_perc, vllm:lora_requests_info, vllm:cache_config_info"
    )
    assert lines[10] == "families missing: (none)"


def test_missing_families_are_null_and_listed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    page = tmp_path / "partial.txt"
    page.write_text(
        '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0"} 3\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
    )
    code, out, _ = run_lig(capsys, "parse", str(page), "--json")
    assert code == 0
    assert json.loads(out) == {
        "waiting": 3,
        "running": None,
        "kv_cache_usage": 0.5,
        "running_adapters": None,
        "waiting_adapters": None,
        "max_lora": None,
        "block_size": None,
        "num_gpu_blocks": None,
        "missing": [RUNNING, LORA_INFO, CACHE_CONFIG],
    }
    code, out, _ = run_lig(capsys, "parse", str(page))
    assert "  running            absent" in out.splitlines()
    assert out.splitlines()[-1] == f"families missing: {RUNNING}, {LORA_INFO}, {CACHE_CONFIG}"


def test_json_from_an_http_server(
    capsys: pytest.CaptureFixture[str], metrics_server: MetricsServer
) -> None:
    code, out, err = run_lig(capsys, "parse", f"{metrics_server.url}/metrics", "--json")
    assert (code, err) == (0, "")
    assert json.loads(out) == V1_JSON


@pytest.mark.parametrize(
    "path,expected",
    [("/nope", "HTTP 404 Not Found"), ("/html", "line 1: not a metric sample or comment")],
)
def test_http_failures_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], metrics_server: MetricsServer, path: str, expected: str
) -> None:
    url = f"{metrics_server.url}{path}"
    code, out, err = run_lig(capsys, "parse", url)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1
    assert err.startswith(f"lig metrics: error: {url}: {expected}")


def test_slow_server_times_out(
    capsys: pytest.CaptureFixture[str], metrics_server: MetricsServer
) -> None:
    code, _, err = run_lig(capsys, "parse", f"{metrics_server.url}/slow", "--timeout", "0.3")
    assert code == 2
    assert "cannot fetch: ReadTimeout" in err
    assert err.count("\n") == 1


def test_nothing_listening_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}/metrics"
    code, _, err = run_lig(capsys, "parse", url)
    assert code == 2
    assert err.startswith(f"lig metrics: error: {url}: cannot fetch: ConnectError")
    assert err.count("\n") == 1


def test_unreadable_file_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "absent.txt"
    code, out, err = run_lig(capsys, "parse", str(missing), "--json")
    assert (code, out) == (2, "")
    assert err == f"lig metrics: error: {missing}: cannot read: No such file or directory\n"


def test_unparsable_file_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    page = tmp_path / "broken.txt"
    page.write_bytes(b'# HELP x\nvllm:num_requests_waiting{engine="0} 3\n')
    code, out, err = run_lig(capsys, "parse", str(page), "--json")
    assert (code, out) == (2, "")
    assert err.startswith(f"lig metrics: error: {page}: line 2: malformed label set")
    assert err.count("\n") == 1


def test_action_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["metrics"])
    assert exit_info.value.code == 2
    assert "parse" in capsys.readouterr().err


def test_console_entry_point_in_a_subprocess() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lig.cli", "metrics", "parse", str(V1_PAGE), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == V1_JSON
