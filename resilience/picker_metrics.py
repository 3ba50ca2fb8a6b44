"""A picker's Prometheus page, read by the resilience tools: fetched once, its samples listed."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


async def picker_samples(url: str) -> list[Sample] | None:
    """Every sample of the page at ``url`` (a picker's ``/metrics``); None when it cannot be
    read (a picker restarting, say)."""
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        try:
            page = (await client.get(url)).text
        except httpx.HTTPError:
            return None
    return [sample for family in text_string_to_metric_families(page)
            for sample in family.samples]
