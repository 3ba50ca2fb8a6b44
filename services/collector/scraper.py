"""One scrape of one pod: fetch its metrics page, parse it, and describe it as a PodMetrics.

A scrape never raises: a timeout, a refused connection, an HTTP error status or a page without
vLLM's metrics all become a snapshot with ``ok=False`` and the reason, so that pickers learn
about a dead pod from the next snapshot instead of from silence.
"""

from __future__ import annotations

import asyncio
import enum
import time

import httpx

from protocols.http_transport import KeepAliveTransport, PageTooLarge, scrape_client
from services.collector.observability import CollectorMetrics
from services.collector.targets import ScrapeTarget
from shared.errors import LigError
from shared.schemas import PodMetrics
from shared.vllm_metrics import MetricsParseError, ParsedMetrics, parse_vllm_metrics

MAX_ERROR_LENGTH = 300


class Outcome(enum.StrEnum):
    """How a scrape ended (the ``outcome`` label of the scrapes counter)."""

    OK = "ok"
    TIMEOUT = "timeout"
    CONNECT_ERROR = "connect_error"
    HTTP_STATUS = "http_status"
    TRANSPORT_ERROR = "transport_error"
    TOO_LARGE = "too_large"
    BAD_PAGE = "bad_page"


class ScrapeFailed(LigError):
    """Internal: why a scrape produced no metrics."""

    def __init__(self, outcome: Outcome, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome


class Scraper:
    """Scrapes pods through one shared keep-alive client; owns that client."""

    def __init__(self, timeout_s: float, user_agent: str, metrics: CollectorMetrics) -> None:
        self._timeout_s = timeout_s
        self._metrics = metrics
        self._transport = KeepAliveTransport()
        self._client = scrape_client(self._transport, user_agent)
        self._requests: dict[str, httpx.Request] = {}
        self._outcomes = {outcome: metrics.scrapes.labels(outcome.value) for outcome in Outcome}

    def close(self, target: ScrapeTarget) -> None:
        """Forget ``target`` (no longer scraped): drop its request and idle connection."""
        self._requests.pop(target.url, None)
        self._transport.discard(target.url)

    async def aclose(self) -> None:
        """Close every connection."""
        await self._client.aclose()

    async def scrape(self, target: ScrapeTarget, seq: int) -> PodMetrics:
        """Scrape ``target`` once; the snapshot carries ``seq`` and the scrape's start time."""
        scrape_time_ns = time.time_ns()
        started = time.perf_counter()
        try:
            page = await self._fetch(target)
            parse_started = time.perf_counter()
            parsed = _parse(page)
            self._metrics.parse_duration.observe(time.perf_counter() - parse_started)
        except ScrapeFailed as failure:
            duration = time.perf_counter() - started
            self._outcomes[failure.outcome].inc()
            self._metrics.scrape_duration.observe(duration)
            return PodMetrics(
                pool=target.pool, pod=target.pod, address=target.address, seq=seq,
                scrape_time_ns=scrape_time_ns, scrape_duration_s=duration, ok=False,
                error=str(failure)[:MAX_ERROR_LENGTH],
            )
        duration = time.perf_counter() - started
        self._outcomes[Outcome.OK].inc()
        self._metrics.scrape_duration.observe(duration)
        return snapshot_from(target, seq, scrape_time_ns, duration, parsed)

    async def _fetch(self, target: ScrapeTarget) -> bytes:
        # Requests are built once per target: building one costs about a tenth of a scrape.
        request = self._requests.get(target.url)
        if request is None:
            request = self._requests[target.url] = self._client.build_request("GET", target.url)
        try:
            # The transport has no timeouts of its own: this bounds the whole exchange.
            async with asyncio.timeout(self._timeout_s):
                response = await self._client.send(request)
        except (TimeoutError, httpx.TimeoutException):
            raise ScrapeFailed(
                Outcome.TIMEOUT, f"timeout: no complete response within {self._timeout_s:.3g} s"
            ) from None
        except httpx.ConnectError as exc:
            raise ScrapeFailed(Outcome.CONNECT_ERROR, f"connect failed: {exc}") from None
        except PageTooLarge as exc:
            raise ScrapeFailed(Outcome.TOO_LARGE, f"too large: {exc}") from None
        except httpx.HTTPError as exc:
            raise ScrapeFailed(Outcome.TRANSPORT_ERROR, f"{type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            message = f"HTTP {response.status_code} from {target.url}"
            raise ScrapeFailed(Outcome.HTTP_STATUS, message)
        return response.content


def _parse(page: bytes) -> ParsedMetrics:
    try:
        parsed = parse_vllm_metrics(page)
    except MetricsParseError as exc:
        raise ScrapeFailed(Outcome.BAD_PAGE, f"unparsable metrics page: {exc}") from None
    if parsed.waiting is None and parsed.running is None and parsed.kv_cache_usage is None:
        raise ScrapeFailed(Outcome.BAD_PAGE, "no vLLM queue or KV-cache metrics on the page")
    return parsed


def snapshot_from(
    target: ScrapeTarget, seq: int, scrape_time_ns: int, duration_s: float, parsed: ParsedMetrics
) -> PodMetrics:
    """The snapshot of a successful scrape; families the page lacked keep their defaults."""
    return PodMetrics(
        pool=target.pool,
        pod=target.pod,
        address=target.address,
        seq=seq,
        scrape_time_ns=scrape_time_ns,
        scrape_duration_s=duration_s,
        ok=True,
        waiting=parsed.waiting or 0,
        running=parsed.running or 0,
        kv_cache_usage=parsed.kv_cache_usage or 0.0,
        running_adapters=parsed.running_adapters or (),
        waiting_adapters=parsed.waiting_adapters or (),
        max_lora=parsed.max_lora,
        block_size=parsed.block_size,
        num_gpu_blocks=parsed.num_gpu_blocks,
        missing=parsed.missing,
    )
