"""Run a policy again on a recorded decision: the draw contract, policy specs, and the policies
kept between decisions.

The draw contract (fixed, shared with the picker that records): a policy is built with
``build_policy(config, rng)`` where ``rng = random.Random()``; before each decision
``rng.seed(record.draw)``; the request is rebuilt from the record with stand-in prefix hashes
``tuple(range(prefix_blocks))`` (a policy reads only how many blocks there are, and the hits);
the pods are ``record.view`` in order. The recorded policy's parameters are the pool's
``policy`` in the registry as recorded at the record's time. (The ``rng`` here is a
:class:`DeferredSeedRandom`: the same numbers, seeded only when a draw can change an answer.)
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from recording.records import PolicyTag, Registry, config_tag
from scheduling import Decision, Policy, PolicyConfigError, SchedulingRequest, build_policy
from scheduling.policies import policy_names
from scheduling.record import DecisionRecord
from shared.schemas import PolicyConfig

if TYPE_CHECKING:
    from _typeshed import SupportsLenAndGetItem

RECORDED = "recorded"  # the policy spec meaning "the pool's recorded policy"
_T = TypeVar("_T")


class PolicySpec(msgspec.Struct, frozen=True):
    """One policy to re-decide with: ``config`` None is the recorded one."""

    label: str
    config: PolicyConfig | None = None


def split_specs(text: str) -> list[str]:
    """``A,B`` split on the commas outside JSON params (``name:{"a":1,"b":2},B`` is two)."""
    parts: list[str] = []
    depth = 0
    quoted = escaped = False
    current: list[str] = []
    for char in text:
        if quoted:
            escaped = char == "\\" and not escaped
            quoted = escaped or char != '"'
        elif char == '"':
            quoted = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    parts.append("".join(current).strip())
    return parts


def parse_policy_spec(text: str) -> PolicySpec:
    """``recorded``, a policy name, or ``name:{JSON params}``; :class:`PolicyConfigError` if the
    policy cannot be built (the error names the spec)."""
    if text == RECORDED:
        return PolicySpec(RECORDED)
    name, colon, raw = text.partition(":")
    params: dict[str, Any] = {}
    if colon:
        try:
            params = msgspec.json.decode(raw, type=dict[str, Any])
        except msgspec.ValidationError:
            raise PolicyConfigError(f"policy {text!r}: params must be a JSON object") from None
        except msgspec.DecodeError as exc:
            raise PolicyConfigError(f"policy {text!r}: params are not JSON: {exc}") from None
    if name not in policy_names():
        known = ", ".join([RECORDED, *policy_names()])
        raise PolicyConfigError(f"unknown policy {name!r} (known: {known})")
    config = PolicyConfig(name=name, params=params)
    build_policy(config, random.Random())  # bad params fail here, before the file is read
    return PolicySpec(text, config)


def parse_policy_specs(text: str) -> list[PolicySpec]:
    """The specs of ``--policies``; :class:`PolicyConfigError` for a bad, empty or repeated
    one."""
    specs: list[PolicySpec] = []
    for part in split_specs(text):
        if not part:
            raise PolicyConfigError(f"--policies {text!r}: an empty policy")
        spec = parse_policy_spec(part)
        if any(known.label == spec.label for known in specs):
            raise PolicyConfigError(f"--policies: {spec.label!r} given twice")
        specs.append(spec)
    return specs


_hashes: dict[int, tuple[int, ...]] = {}
_SHARED_HASHES = 1024  # stand-in tuples up to this many blocks are made once and shared


def scheduling_request(record: DecisionRecord) -> SchedulingRequest:
    """The request the policy saw, per the draw contract."""
    blocks = record.prefix_blocks
    hashes = _hashes.get(blocks)
    if hashes is None:
        hashes = tuple(range(blocks))
        if blocks <= _SHARED_HASHES:
            _hashes[blocks] = hashes
    return SchedulingRequest(record.model, record.target_model, record.criticality,
                             record.prompt_tokens, record.max_tokens, hashes,
                             record.prefix_hits)


class RecordedPolicy(msgspec.Struct, frozen=True):
    """The policy a record was decided by: ``tag`` changes whenever the config does."""

    tag: PolicyTag
    config: PolicyConfig
    fallback: bool  # the registry named no pool or another policy: the record's name, defaults


_defaults: dict[str, RecordedPolicy] = {}


def recorded_policy(registry: Registry, pool: str, record: DecisionRecord) -> RecordedPolicy:
    """The pool's policy in the recorded registry at the record's time; if the registry has no
    such pool or names a policy other than the record's (a change racing the decision), the
    record's policy with default parameters."""
    named = registry.tagged_policy(pool, record.time_ns)
    if named is not None and named[0].name == record.policy:
        return RecordedPolicy(named[1], named[0], False)
    fallback = _defaults.get(record.policy)
    if fallback is None:
        config = PolicyConfig(name=record.policy)
        fallback = RecordedPolicy(config_tag(config), config, True)
        if len(_defaults) < len(policy_names()) * 4:  # names from a file: bounded
            _defaults[record.policy] = fallback
    return fallback


class DeferredSeedRandom(random.Random):
    """A ``random.Random`` whose ``seed(int)`` takes effect at its first draw: the same numbers,
    in the same order, as ``random.Random`` seeded the same way (the draw contract holds).

    Why: seeding the Mersenne Twister costs ~6 µs, a sixth of a re-run decision, and most
    decisions end in a choice among one candidate, whose answer no draw changes. Such a choice
    only notes the bit it would have drawn (``_randbelow(1)``: ``getrandbits(1)`` until 0);
    should anything draw later, the seed is applied and the owed bits drawn first.
    """

    def __init__(self) -> None:
        self._pending: int | None = None  # the seed not applied yet
        self._owed = 0  # one-element choices made since it was given
        super().__init__()

    def seed(self, a: Any = None, version: int = 2) -> None:
        """Defer an int seed; anything else seeds at once."""
        self._owed = 0
        if type(a) is int and version == 2:
            self._pending = a
            self.gauss_next = None
        else:
            self._pending = None
            super().seed(a, version)

    def _apply(self) -> None:
        seed, owed = self._pending, self._owed
        self._pending, self._owed = None, 0
        super().seed(seed)
        for _ in range(owed):
            while super().getrandbits(1):
                pass

    def choice(self, seq: SupportsLenAndGetItem[_T]) -> _T:
        """``random.Random.choice``; one element is chosen without seeding."""
        if self._pending is not None and len(seq) == 1:
            self._owed += 1
            return seq[0]
        return super().choice(seq)

    def getrandbits(self, k: int) -> int:
        """``random.Random.getrandbits`` (every integer draw goes through it)."""
        if self._pending is not None:
            self._apply()
        return super().getrandbits(k)

    def random(self) -> float:
        """``random.Random.random`` (every float draw goes through it)."""
        if self._pending is not None:
            self._apply()
        return super().random()

    def getstate(self) -> tuple[Any, ...]:
        """The state, the deferred seed applied first."""
        if self._pending is not None:
            self._apply()
        return super().getstate()

    def setstate(self, state: tuple[Any, ...]) -> None:
        """Restore ``state``; a deferred seed is dropped."""
        self._pending, self._owed = None, 0
        super().setstate(state)


class _Slot(msgspec.Struct):
    tag: object
    policy: Policy | None  # None: the config does not build (an error kept, not retried)
    rng: random.Random
    error: str = ""


class Rerunner:
    """One policy instance per (picker, pool, spec), as each picker keeps one per pool, so a
    stateful policy (round-robin) sees the decisions in the order that picker made them.
    Rebuilt when its config changes (``tag``)."""

    def __init__(self) -> None:
        self._slots: dict[tuple[str, str, str], _Slot] = {}

    def decide(self, label: str, tag: object, config: PolicyConfig, picker: str, pool: str,
               record: DecisionRecord, request: SchedulingRequest,
               explain: bool = False) -> Decision:
        """``config``'s decision on ``record``; :class:`PolicyConfigError` if it cannot be
        built."""
        key = (picker, pool, label)
        slot = self._slots.get(key)
        if slot is None or slot.tag != tag:
            rng = DeferredSeedRandom()
            try:
                slot = _Slot(tag, build_policy(config, rng), rng)
            except PolicyConfigError as exc:
                slot = _Slot(tag, None, rng, str(exc))
            self._slots[key] = slot
        if slot.policy is None:
            raise PolicyConfigError(slot.error)
        slot.rng.seed(record.draw)
        return slot.policy.schedule(request, record.view, explain=explain)
