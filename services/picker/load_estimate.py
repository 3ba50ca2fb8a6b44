"""The picker's estimate of the load its pods have not reported yet.

Between two scrapes of a pod (50 ms by default) every decision sees the same snapshot, so a
policy that keeps the pods with the least queue or KV usage sends every request of that window to
the same one or two pods (herding). The picker knows what it sent: per pod, the requests it routed
there since the pod's newest snapshot arrived. The count restarts when a newer snapshot of the pod
arrives, which shows those requests (waiting or running).

A policy sees each pod's ``waiting`` raised by its count *minus the smallest count among the
pods*: only what a pod got beyond the least-served one. The queue bands of the filter tree rank
pods relative to the lowest queue, so they see the full correction; but requests spread evenly
over every pod are mostly running, not waiting, and counting them all as queue would lift the
whole pool over the tree's absolute thresholds (a sheddable request needs a pod with
``waiting <= 5``), shedding below capacity when scrapes are slow.

Approximations: the count restarts when a snapshot *arrives*, not when it was taken, so requests
routed between a scrape and its arrival (scrape duration plus the NATS hop, about 5 ms of a 50 ms
interval) are counted by neither. Prompt tokens are counted beside the requests and shown to
policies as ``PodView.unreported_tokens``, in full, not relative to the least-loaded pod: the
``token_load`` scorer rates them on an absolute scale. KV usage itself is not corrected.

The tokens counted are those the pod will have to *prefill* (:func:`prefill_tokens`): the prompt's
estimate (``scheduling/prompt.py``) minus the leading blocks the pod holds according to the prefix
index the decision used (precise hits when the pool has them, else approximate). Counting whole
prompts made the pod holding a popular prefix look loaded by the very requests that hit its
cache, so the next request of that prefix went elsewhere and missed (docs/benchmarks.md, "Prefix
sources"). Peers' routed events carry the same figure (docs/decision-stream.md).

This corrects the policies' input, not the policies: ``lig picker --no-load-estimate`` turns it
off, leaving decisions on the scraped metrics alone, as upstream.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from scheduling.types import PodView


def prefill_tokens(prompt_tokens: int, hits: int, blocks: int, block_tokens: int) -> int:
    """The tokens of a prompt of ``prompt_tokens`` (estimated) that a pod holding ``hits`` of
    its ``blocks`` leading blocks looked up still has to compute.

    The cached part is the hit fraction of the prompt, ``prompt_tokens * hits / blocks``, but at
    most ``hits * block_tokens`` (the most tokens a block holds): the blocks looked up may cover
    only the start of a prompt (lookups are capped, a batch hashes its first prompt only), and a
    pod never holds the partial last block."""
    if hits <= 0 or blocks <= 0:
        return prompt_tokens
    return prompt_tokens - min(prompt_tokens * hits // blocks, hits * block_tokens)


class UnreportedLoad:
    """Per pod, the requests and prompt tokens routed there since its newest snapshot (always
    none when disabled)."""

    __slots__ = ("_counts", "_tokens", "enabled")

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._counts: dict[str, int] = {}
        self._tokens: dict[str, int] = {}

    def routed(self, pod: str, tokens: int = 0) -> None:
        """A request with ``tokens`` estimated prompt tokens was sent to ``pod``."""
        if self.enabled:
            self._counts[pod] = self._counts.get(pod, 0) + 1
            if tokens > 0:
                self._tokens[pod] = self._tokens.get(pod, 0) + tokens

    def unrouted(self, pod: str, tokens: int = 0) -> None:
        """A request counted for ``pod`` went elsewhere after all (a gateway fallback)."""
        count = self._counts.get(pod, 0) - 1
        if count > 0:
            self._counts[pod] = count
        else:
            self._counts.pop(pod, None)
        left = self._tokens.get(pod, 0) - tokens
        if left > 0 and count > 0:
            self._tokens[pod] = left
        else:
            self._tokens.pop(pod, None)

    def reported(self, pod: str) -> None:
        """A newer snapshot of ``pod`` arrived: it shows the requests counted so far."""
        self._counts.pop(pod, None)
        self._tokens.pop(pod, None)

    @property
    def counts(self) -> Mapping[str, int]:
        """Requests per pod that its newest snapshot does not show (pods with none absent)."""
        return self._counts

    @property
    def tokens(self) -> Mapping[str, int]:
        """Prompt tokens per pod that its newest snapshot does not show (pods with none absent)."""
        return self._tokens


def picker_views(
    views: Sequence[PodView], in_flight: Mapping[str, int], unreported: Mapping[str, int],
    unreported_tokens: Mapping[str, int] | None = None,
) -> list[PodView]:
    """``views`` as a policy sees them: with this picker's in-flight counts, ``waiting`` raised
    by each pod's unreported requests beyond the fewest any of ``views`` has, and each pod's
    unreported prompt tokens (in full: token scorers compare pods on their own scale)."""
    tokens = unreported_tokens or {}
    if not views or (not in_flight and not unreported and not tokens):
        return list(views)
    # Counts are positive: with fewer counted pods than views, some view has none.
    if len(unreported) < len(views):
        fewest = 0
    else:
        fewest = min([unreported.get(view.name, 0) for view in views])
    replace = msgspec.structs.replace
    result = []
    for view in views:
        name = view.name
        requests = in_flight.get(name, 0)
        extra = unreported.get(name, 0) - fewest
        routed_tokens = tokens.get(name, 0)
        if requests or extra or routed_tokens:
            view = replace(view, waiting=view.waiting + extra, in_flight=requests,
                           unreported_tokens=routed_tokens)
        result.append(view)
    return result
