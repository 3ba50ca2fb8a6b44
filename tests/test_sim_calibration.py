"""Calibration: at low load, TTFT and inter-token latency are what the profile says.

Exact in virtual time; loose over real HTTP on the wall clock, where a busy host only adds delay.
"""

from __future__ import annotations

import json
import statistics
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator.engine import EngineConfig, RequestSpec
from simulator.profiles import PROFILES
from simulator.virtual_time import Arrival, VirtualFleet
from tests.support.simulator import SimulatedPods

PROFILE = PROFILES["llama-3.1-8b-h100"]


def headline_ttft(prompt: int) -> float:
    """The profile's headline numbers: one prefill step."""
    return PROFILE.b0 + PROFILE.b1 * prompt


def headline_itl() -> float:
    """The profile's headline numbers: one decode step of one request."""
    return PROFILE.b0 + PROFILE.b2


@pytest.mark.parametrize("prompt", [128, 1000, 4000])
def test_virtual_time_ttft_and_itl_match_the_profile(prompt: int) -> None:
    output = 100
    arrivals = [
        Arrival(10.0 * index, RequestSpec(f"r{index}", tuple(range(index, index + prompt)), output))
        for index in range(3)  # far apart: each runs alone, without a cache hit
    ]
    run = VirtualFleet([EngineConfig()]).run(arrivals)
    for result in run.requests:
        assert result.ttft is not None and result.itl_mean is not None
        assert result.ttft == pytest.approx(headline_ttft(prompt), rel=0.10)
        assert result.itl_mean == pytest.approx(headline_itl(), rel=0.10)
        # Exactly the step-time model, context term included.
        assert result.ttft == pytest.approx(PROFILE.step_time(prompt, 0, prompt), rel=1e-9)
        mean_context = prompt + output / 2
        assert result.itl_mean == pytest.approx(PROFILE.step_time(0, 1, mean_context), rel=1e-9)


def test_real_time_over_http_matches_the_profile_loosely() -> None:
    prompt, output = 1000, 30
    with SimulatedPods(1, time_scale=1.0) as pods, httpx.Client(timeout=10.0) as client:
        ttfts, itls = [], []
        for index in range(3):
            body = {
                "prompt": list(range(index * prompt, (index + 1) * prompt)),
                "max_tokens": output,
                "stream": True,
            }
            times = []
            started = time.monotonic()
            with client.stream("POST", pods.url(0) + "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        assert json.loads(line[6:])["choices"][0]["text"]
                        times.append(time.monotonic())
            assert len(times) == output
            ttfts.append(times[0] - started)
            itls.append((times[-1] - times[0]) / (output - 1))
        page = client.get(pods.url(0) + "/metrics").text

    expected_ttft = PROFILE.step_time(prompt, 0, prompt)
    expected_itl = PROFILE.step_time(0, 1, prompt + output / 2)
    # What the engine measured (simulated time, paced by the wall clock): the profile's values.
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if not s.labels.get("le")
    }
    engine_ttft = (
        samples["vllm:time_to_first_token_seconds_sum"]
        / samples["vllm:time_to_first_token_seconds_count"]
    )
    engine_itl = (
        samples["vllm:inter_token_latency_seconds_sum"]
        / samples["vllm:inter_token_latency_seconds_count"]
    )
    assert engine_ttft == pytest.approx(expected_ttft, rel=0.10)
    assert engine_itl == pytest.approx(expected_itl, rel=0.10)
    # What a client sees on the wall clock: never faster, and late only by host delays.
    assert expected_ttft * 0.9 <= statistics.median(ttfts) <= expected_ttft + 0.5
    assert expected_itl * 0.9 <= statistics.median(itls) <= expected_itl * 3 + 0.01
