"""The load estimate counts the prompt tokens a pod must prefill, not the whole prompt (pure: no
network): the arithmetic, own requests (approximate and precise prefix hits, fallbacks), and
peers' routed events, with pickers that predate ``RoutedEvent.prefill_tokens``."""

from __future__ import annotations

import msgspec

from scheduling.prompt import BLOCK_TOKENS
from services.picker.load_estimate import prefill_tokens
from services.picker.pools import Gateway
from services.picker.routing import Routed
from shared.schemas import (
    Criticality,
    DecisionBatch,
    DecisionEvent,
    RoutedEvent,
    decode,
    encode,
)
from tests.test_picker_peer_decisions import LONG_BODY, POOL, FakeClock, batch, gateway
from tests.test_picker_precise_routing import BS, chat_ids, publishing_fleet, store
from tests.test_picker_prompt_routing import SYSTEM, chat

# LONG_BODY's prompt: 4,200 characters, 1,050 tokens; its bytes make 4 full blocks of 1 KiB.
PROMPT_TOKENS = 1050
CACHED = 4 * BLOCK_TOKENS  # a pod holding all 4 blocks holds their 1,024 tokens, not the tail


def test_a_miss_prefills_the_whole_prompt() -> None:
    assert prefill_tokens(1050, 0, 4, 256) == 1050
    assert prefill_tokens(1050, 0, 0, 256) == 1050  # no blocks looked up (a short prompt)


def test_a_hit_prefills_what_its_leading_blocks_do_not_hold() -> None:
    assert prefill_tokens(5000, 250, 312, 16) == 1000  # a 4,000-token prefix held
    assert prefill_tokens(4096, 256, 256, 16) == 0
    # Blocks holding fewer tokens than they could (multi-byte text): the hit fraction binds.
    assert prefill_tokens(800, 2, 4, 256) == 400


def test_the_cached_part_is_at_most_the_hit_blocks_tokens() -> None:
    # 2,048 blocks of 16 looked up (the cap) of a 100,000-token prompt, all held: the hit
    # fraction would say all of it is cached; the blocks hold 32,768 tokens.
    assert prefill_tokens(100_000, 2048, 2048, 16) == 100_000 - 2048 * 16
    # A full hit of a prompt whose last block is partial: the tail is still computed.
    assert prefill_tokens(1050, 4, 4, 256) == 1050 - 1024


def _unreported(gw: Gateway) -> dict[str, int]:
    table = gw.table(POOL)
    assert table is not None
    return {view.name: view.unreported_tokens for view in table.fresh_views()}


def _route_to(gw: Gateway, body: bytes, routed_first: Routed) -> Routed:
    """``body`` routed to ``routed_first``'s pod (the gateway's subset hint names only it)."""
    result = gw.route(body, frozenset({routed_first.endpoint}))
    assert isinstance(result, Routed) and result.pod == routed_first.pod
    return result


def test_a_request_hitting_its_pods_cache_adds_only_its_uncached_tokens() -> None:
    gw = gateway(FakeClock())
    first = gw.route(LONG_BODY)
    assert isinstance(first, Routed) and first.prompt_tokens == PROMPT_TOKENS
    gw.started(first)
    assert _unreported(gw)[first.pod] == PROMPT_TOKENS  # cold: the whole prompt
    again = _route_to(gw, LONG_BODY, first)
    gw.started(again)
    assert _unreported(gw)[first.pod] == PROMPT_TOKENS + PROMPT_TOKENS - CACHED


def test_a_request_missing_its_pods_cache_adds_all_its_tokens() -> None:
    gw = gateway(FakeClock())
    first = gw.route(LONG_BODY)
    assert isinstance(first, Routed)
    gw.started(first)
    other = _route_to(gw, LONG_BODY.replace(b"a long", b"b long"), first)
    gw.started(other)
    assert _unreported(gw)[first.pod] == 2 * PROMPT_TOKENS


def test_a_fallback_moves_the_hit_and_counts_the_prompt_where_it_was_served() -> None:
    gw = gateway(FakeClock())
    first = gw.route(LONG_BODY)
    assert isinstance(first, Routed)
    gw.started(first)
    again = _route_to(gw, LONG_BODY, first)
    gw.started(again)
    elsewhere = next(name for name in _unreported(gw) if name != first.pod)
    gw.served_elsewhere(again, elsewhere)  # a pod without the prefix served it
    tokens = _unreported(gw)
    assert tokens[first.pod] == PROMPT_TOKENS and tokens[elsewhere] == PROMPT_TOKENS


def test_a_precise_hit_adds_the_tokens_after_the_cached_token_blocks() -> None:
    fleet = publishing_fleet()
    gw = Gateway.serving(fleet.router)
    system = "[precise] " + SYSTEM
    ids = chat_ids(system, "q")
    store(fleet, "pod-1", ids, 500_000)  # pod-1's events show every full block of the prompt
    result = gw.route(msgspec.json.encode(chat(system, "q")))
    assert isinstance(result, Routed) and result.pod == "pod-1"
    gw.started(result)
    views = {view.name: view.unreported_tokens for view in fleet.pods.fresh_views()}
    # The estimate (4 characters a token) exceeds the tokenizer's count: the cached part is
    # the held blocks' tokens, not the hit fraction (all) of the estimate.
    blocks = len(ids) // BS
    assert result.prompt_tokens > len(ids)
    assert views["pod-1"] == result.prompt_tokens - blocks * BS
    assert result.prefill_on("pod-0") == result.prompt_tokens  # pod-0 caches none of it


def test_peers_count_the_uncached_tokens_the_routing_picker_expects() -> None:
    events: list[tuple[str, DecisionEvent]] = []
    sender, receiver = gateway(FakeClock(), events=events), gateway(FakeClock())
    first = sender.route(LONG_BODY)
    assert isinstance(first, Routed)
    sender.started(first)
    again = _route_to(sender, LONG_BODY, first)
    sender.started(again)
    event = events[-1][1]
    assert isinstance(event, RoutedEvent)
    assert (event.prompt_tokens, event.prefill_tokens) == (PROMPT_TOKENS, PROMPT_TOKENS - CACHED)
    receiver.apply_peer(batch("sender", *(event for _, event in events)))
    assert _unreported(receiver) == _unreported(sender)
    assert _unreported(receiver)[first.pod] == 2 * PROMPT_TOKENS - CACHED


class _OldRoutedEvent(msgspec.Struct, frozen=True, tag="r", array_like=True):
    """``RoutedEvent`` as pickers that predate ``prefill_tokens`` define it."""

    request_id: int
    pod: str
    target_model: str
    criticality: Criticality
    prompt_tokens: int = 0
    max_tokens: int = 0
    prefix_hashes: tuple[int, ...] = ()


class _OldBatch(msgspec.Struct, frozen=True):
    picker: str
    pool: str
    sent_at_ns: int
    events: list[_OldRoutedEvent]
    heartbeat_s: float = 0.5
    schema: int = 1


def test_old_and_new_pickers_read_each_others_routed_events() -> None:
    new = DecisionBatch("new", POOL, 1, [RoutedEvent(5, "pod-a", "m", Criticality.STANDARD,
                                                     PROMPT_TOKENS, 64, (1, 2), 26)])
    old = msgspec.msgpack.decode(encode(new), type=_OldBatch)
    assert old.events == [_OldRoutedEvent(5, "pod-a", "m", Criticality.STANDARD,
                                          PROMPT_TOKENS, 64, (1, 2))]
    from_old = decode(msgspec.msgpack.encode(old), DecisionBatch)
    event = from_old.events[0]
    assert isinstance(event, RoutedEvent) and event.prefill_tokens is None
    receiver = gateway(FakeClock())
    receiver.apply_peer(msgspec.structs.replace(from_old, picker="old"))
    receiver.apply_peer(msgspec.structs.replace(new, picker="new-peer"))
    # The old picker's event counts its whole prompt, the new one's its uncached part.
    assert _unreported(receiver)["pod-a"] == PROMPT_TOKENS + 26
