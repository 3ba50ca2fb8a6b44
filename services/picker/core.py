"""The picker's decision core, built one way for ``lig picker`` and ``lig bench``.

The core is a :class:`~services.picker.pools.Gateway`: per served pool a
:class:`~services.picker.routing.Router` (model resolution with the weighted draw, criticality,
the pool's policy) over a :class:`~services.picker.state.PodTable` (snapshots, freshness, load
estimate, in-flight counts, gray pods). ext_proc feeds it request bodies (``route``) and stream
ends (``started`` / ``finished``); the metrics feed feeds it snapshots. The benchmark drives the
very same objects in virtual time (``clock``), so its numbers describe the code that ships.

It is configured with ``lig picker``'s own settings
(:class:`~services.picker.settings.PickerSettings`): ``lig picker`` passes its flags, the
benchmark the defaults (plus its pool), so ``lig bench --policies default`` runs exactly what a
picker started without flags runs. ``lig explain`` (pod views from a ``PodTable``) and the
recording re-run (the recorded views) call the policy alone: no model resolution, prefix index
or fallbacks.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping

import msgspec

from scheduling.prompt_tokenizers import TokenizerLoadError, load_pool_tokenizers
from scheduling.token_blocks import PromptTokenizer
from services.picker.gray_pods import GrayPods
from services.picker.pools import Gateway, UnknownModels
from services.picker.routing import DecisionCallback, RecordCallback, Router
from services.picker.settings import PickerSettings
from services.picker.state import PodTable
from shared.errors import ConfigError


class CoreHooks(msgspec.Struct, frozen=True):
    """Where the core reports what a service counts (all optional: a tool ignores them)."""

    on_gray_exclusion: Callable[[str, str], None] = lambda pod, reason: None
    on_all_stale: Callable[[], None] = lambda: None
    on_conflicts: Callable[[int], None] = lambda count: None


def load_tokenizers(settings: PickerSettings) -> dict[str, PromptTokenizer]:
    """The pools' tokenizers of ``--tokenizer``; one that cannot be loaded raises
    :class:`ConfigError` (exit 2) naming the flag, the pool and the file."""
    try:
        return load_pool_tokenizers(settings.tokenizer_specs)
    except TokenizerLoadError as error:
        raise ConfigError(f"--tokenizer (env LIG_TOKENIZER): {error}") from None


def build_gateway(settings: PickerSettings, *, rng: random.Random | None = None,
                  clock: Callable[[], float] = time.monotonic, hooks: CoreHooks | None = None,
                  on_decision: DecisionCallback | None = None,
                  picker_id: str = "", on_record: RecordCallback | None = None,
                  tokenizers: Mapping[str, PromptTokenizer] | None = None,
                  wall_clock: Callable[[], int] = time.time_ns) -> Gateway:
    """The decision core over ``settings.pools`` (empty: every pool of the registry), with the
    settings' staleness, load estimate, gray-pod, fallback and unknown-model behaviour.

    ``rng`` defaults to one seeded with ``settings.seed``; ``tokenizers`` (pool -> tokenizer,
    for precise prefix routing) to those of ``settings.tokenizers``.
    ``clock`` is the time freshness and gray pods are judged on (virtual time in the bench);
    ``wall_clock`` (unix ns, virtual in the bench) is compared with snapshots' scrape times and
    peers' send times, for the age of what the core knows.
    ``on_decision(pool, event)`` receives the core's own routed/finished/shed events for the
    decision stream, ``picker_id`` naming this picker in it (its own batches are not applied
    twice); peers' events are applied with ``Gateway.apply_peer`` and expire on ``clock``
    (``Gateway.expire_peers``, after ``settings.decision_request_ttl`` for a lone request).
    ``on_record(pool, record)`` receives the flight recorder's records (None: not recording).
    """
    hooks = hooks if hooks is not None else CoreHooks()
    rng = rng if rng is not None else random.Random(settings.seed)
    tokenizers = tokenizers if tokenizers is not None else load_tokenizers(settings)

    def make_router(pool: str) -> Router:
        pods = PodTable(settings.stale_after, clock=clock, load_estimate=settings.load_estimate,
                        gray=GrayPods(settings.gray_after, settings.outcome_sample,
                                      on_exclude=hooks.on_gray_exclusion),
                        wall_clock=wall_clock)
        router = Router(pool, pods, rng, on_all_stale=hooks.on_all_stale,
                        fallbacks=settings.fallbacks,
                        prefix_entries=settings.prefix_index_entries,
                        precise_blocks=settings.precise_blocks,
                        speculative_ttl=settings.speculative_ttl, clock=clock,
                        precise_recovery_s=settings.precise_recovery_s)
        # None: the router logs once, when the pool's pods publish KV events, that it uses
        # the approximate index.
        router.tokenizer = tokenizers.get(pool)
        return router

    unknown = UnknownModels(reject=settings.reject_unknown_models,
                            default_pool=settings.default_pool)
    return Gateway(settings.pools, make_router, unknown, rng, on_conflicts=hooks.on_conflicts,
                   on_decision=on_decision, picker_id=picker_id, clock=clock,
                   request_ttl=settings.decision_request_ttl, on_record=on_record)
