"""The attack and chaos tools, short and bounded, against a stack they start: every scenario
runs and yields its figures, so the tools cannot rot. The targets a short run can show are
asserted too: every control-frame flood closed by the picker, every bad HTTP request answered
with a status and an OpenAI-shaped error, no memory growth from the header amplification, and
no request lost to a killed collector or ``lig kv-events``. Issue 26's faults (``kv-events``,
``picker-streams``) run with the block witness and yield their index figures; whether the
pickers' indexes meet their target is for the full run (``make chaos``; NATS's kill, slower to
recover, runs only there). (Timing targets need the full run: docs/resilience.md.)"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from resilience import attacks, bad_http, chaos
from resilience.__main__ import main
from resilience.attack import AttackSettings, run_attacks
from resilience.report import Figure
from resilience.stack import own_stack

pytestmark = pytest.mark.timeout(90)

SHORT_ATTACKS = AttackSettings(duration=1.0, rate=20, streams=200, settings_frames=3,
                               amplification_frames=100, amplification_seconds=1.0,
                               header_frames=1, partial_streams=1,
                               control_frames=5000, slow_connections=5, slow_hold=1.0,
                               request_timeout=10)
SHORT_FAULTS = chaos.ChaosSettings(faults=("collector", "kv-events", "picker-streams"), rate=20,
                                   before=0.5, outage=1.0, settle=1.0, index_check=1.0,
                                   streams_in_flight=1, request_timeout=10)
INDEX_VALUE = re.compile(r"(\d+) of (\d+) true blocks \([+-]\d+\.\d%\), (\d+) pods incomplete: "
                         r"(within|incomplete|within \+ incomplete|neither) "
                         r"\(before the fault: [+-]\d+\.\d%, \d+ incomplete\)")


def _named(figures: list[Figure], scenario: str, name: str) -> Figure:
    matches = [f for f in figures if f.scenario == scenario and f.name == name]
    assert len(matches) == 1, (scenario, name, figures)
    return matches[0]


async def test_every_attack_and_some_faults_run_and_report() -> None:
    async with own_stack(pods=2, pickers=2, witness=True,
                         replay_buffer=chaos.REPLAY_BUFFER) as stack:
        figures = await run_attacks(lambda: stack.target, SHORT_ATTACKS)
        faults = await chaos.run_chaos(stack, SHORT_FAULTS)
        assert stack.unexpected_exit() is None

    for picker in ("picker-0", "picker-1"):
        assert _named(figures, "baseline", f"{picker} PING answered within").passed is None
        opened = _named(figures, "stream flood", f"{picker} streams opened / refused")
        assert opened.value.startswith("200 / ")
        ping = _named(figures, "stream flood", f"{picker} PING answered within")
        assert int(re.search(r"(\d+) pings", ping.value)[1]) > 0  # type: ignore[index]
    assert _named(figures, "amplification", "sent").value.startswith("100 HEADERS frames")
    assert _named(figures, "huge header block", "sent").value.startswith("1 1 MiB HEADERS")
    assert _named(figures, "partial messages", "sent").value.startswith("8 1 MiB frames")
    # Up to 5: the tool opens what it can within the hold (1 s), fewer on a loaded machine.
    assert re.fullmatch(r"\d+/[1-5]", _named(
        figures, "slow peers", "silent connections closed within 1 s").value)
    amplified = _named(figures, "amplification", "picker-0 RSS growth")
    assert amplified.passed, amplified
    for flood in attacks.CONTROL_FLOODS:
        closed = _named(figures, flood, "connection closed by the picker")
        assert closed.passed, closed
        assert _named(figures, flood, "picker-0 RSS growth").passed is not None
    assert [f.name for f in figures if f.scenario == "bad HTTP"] == list(bad_http.CASES)
    control = _named(figures, "bad HTTP", "body not JSON (control)")
    assert (control.value, control.passed) == ("400 invalid_json", True)
    for figure in figures:
        if figure.scenario == "bad HTTP":
            assert figure.passed, figure
    for figure in figures:
        if figure.name == "requests through Envoy failed":
            assert re.match(r"\d+\.\d% \(\d+/[1-9]\d*", figure.value), figure

    for fault in ("collector", "kv-events"):  # neither is on the request path
        lost = _named(faults, fault, "requests lost")
        assert lost.passed, lost  # issue 13: keep it 0
        assert _named(faults, fault, "answers naming another model").passed
    assert re.fullmatch(r"\d+ \(over all pickers\)", _named(
        faults, "picker-streams", "rewritten streams in flight at the kill").value)
    for fault in SHORT_FAULTS.faults:
        for picker in ("picker-0", "picker-1"):
            index = _named(faults, fault, f"{picker} precise index 1 s after the fault")
            if (fault, picker, index.value) == ("picker-streams", "picker-0",
                                                "metrics unreadable"):
                continue  # restarted 1 s ago: a loaded machine may not have it serving yet
            match = INDEX_VALUE.fullmatch(index.value)
            assert match, index
            assert int(match[2]) > 0, index  # the chats' system prompt is cached and announced
        assert "picker-0" in _named(faults, fault, "picker RSS at the start -> at the check").value
    witness = _named(faults, "witness", "KV-event batches heard / missed")
    assert witness.passed, witness  # connected before any traffic: it missed nothing


def test_the_command_line_explains_itself(capsys: pytest.CaptureFixture[str]) -> None:
    result = subprocess.run([sys.executable, "-m", "resilience", "--help"],
                            capture_output=True, text=True, timeout=30, check=True)
    assert "{attack,chaos,soak}" in result.stdout
    for tool in ("attack", "chaos", "soak"):
        with pytest.raises(SystemExit) as help_exit:
            main([tool, "--help"])
        assert help_exit.value.code == 0
        assert f"usage: python -m resilience {tool}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        main(["attack", "--only", "nope"])
    assert bad.value.code == 2 and "choose from flood" in capsys.readouterr().err
