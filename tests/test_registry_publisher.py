"""Publishing the registry into JetStream KV (real nats-server): contents, diffs, deletes."""

from __future__ import annotations

import pytest
from nats.aio.client import Client
from nats.js.api import KeyValueConfig

from services.registry.files import FileSnapshot, SourceFile, load
from services.registry.guard import removal_refusal
from services.registry.loader import Registry
from services.registry.publisher import (
    HISTORY,
    Publisher,
    RemovalRefused,
    desired_entries,
    plan,
    read_bucket,
)
from shared.schemas import EndpointSet, InferenceModel, InferencePool, decode
from shared.subjects import Subjects
from tests.support.registry_yaml import dump, model, pool

BUCKET = Subjects().registry_bucket


def registry_of(*documents: dict) -> Registry:
    return load(FileSnapshot((SourceFile("r.yaml", dump(*documents)),)))


async def bucket_contents(nc: Client) -> dict[str, tuple[bytes, int]]:
    """Live keys of the bucket with their value and revision."""
    entries = await read_bucket(nc.jetstream(), BUCKET)
    return {key: (entry.value or b"", entry.revision or 0) for key, entry in entries.items()}


def test_plan_orders_puts_pools_first_and_deletes_models_first() -> None:
    desired = {"model.p.m2": b"m2", "endpoints.p": b"e", "pool.p": b"p2", "model.p.m1": b"m1"}
    current = {"pool.p": b"p1", "model.p.m1": b"m1", "model.p.old": b"x", "pool.q": b"q",
               "endpoints.q": b"e", "other.key": b"not ours"}
    done = plan(desired, current)
    assert [key for key, _ in done.puts] == ["pool.p", "endpoints.p", "model.p.m2"]
    assert done.deletes == ("model.p.old", "endpoints.q", "pool.q")
    assert done.unchanged == 1


async def test_files_become_kv_contents_in_a_bucket_with_history(nc: Client) -> None:
    llama = model("llama", modelName="meta-llama/Llama-3.1-8B-Instruct")
    registry = registry_of(pool(), pool("pool.b", endpoints=0), model(criticality="Sheddable"),
                           llama)
    done = await Publisher(nc.jetstream(), BUCKET).publish(registry)
    assert len(done.puts) == 6 and not done.deletes

    contents = await bucket_contents(nc)
    # Names are escaped into single key tokens (shared.subjects.escape_token).
    assert sorted(contents) == [
        "endpoints.pool-a", "endpoints.pool=2Eb", "model.pool-a.meta-llama/Llama-3=2E1-8B-Instruct",
        "model.pool-a.model-a", "pool.pool-a", "pool.pool=2Eb",
    ]
    assert {key: value for key, (value, _) in contents.items()} == desired_entries(registry)
    assert decode(contents["pool.pool-a"][0], InferencePool) == registry.pools[0]
    assert decode(contents["endpoints.pool-a"][0], EndpointSet) == registry.endpoint_sets[0]
    sheddable = decode(contents["model.pool-a.model-a"][0], InferenceModel)
    assert sheddable.criticality == "Sheddable"
    status = await (await nc.jetstream().key_value(BUCKET)).status()
    assert status.history == HISTORY


async def test_unchanged_objects_are_not_rewritten_and_removed_ones_are_deleted(
    nc: Client,
) -> None:
    publisher = Publisher(nc.jetstream(), BUCKET)
    await publisher.publish(registry_of(pool(), model(), model("model-b")))
    before = await bucket_contents(nc)

    edited = registry_of(pool(), model(criticality="Critical"))
    done = await publisher.publish(edited)
    assert [key for key, _ in done.puts] == ["model.pool-a.model-a"]
    assert done.deletes == ("model.pool-a.model-b",)
    after = await bucket_contents(nc)
    assert set(after) == {"pool.pool-a", "endpoints.pool-a", "model.pool-a.model-a"}
    assert after["pool.pool-a"] == before["pool.pool-a"]  # same revision: not rewritten
    assert after["model.pool-a.model-a"][1] > before["model.pool-a.model-a"][1]

    # The delete is a KV delete marker, kept in the key's history.
    kv = await nc.jetstream().key_value(BUCKET)
    history = await kv.history("model.pool-a.model-b")
    assert [entry.operation for entry in history] == [None, "DEL"]

    again = await publisher.publish(edited)
    assert (again.puts, again.deletes, again.unchanged) == ((), (), 3)


async def test_two_instances_with_the_same_inputs_converge_without_rewrites(nc: Client) -> None:
    registry = registry_of(pool(), model())
    first, second = Publisher(nc.jetstream(), BUCKET), Publisher(nc.jetstream(), BUCKET)
    await first.publish(registry)
    done = await second.publish(registry)
    assert (done.puts, done.deletes, done.unchanged) == ((), (), 3)


async def test_keys_outside_the_registry_families_are_left_alone(nc: Client) -> None:
    kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket=BUCKET, history=1))
    await kv.put("notes.owner", b"team-a")
    await Publisher(nc.jetstream(), BUCKET).publish(registry_of(pool()))
    contents = await bucket_contents(nc)
    assert contents["notes.owner"][0] == b"team-a"
    assert "pool.pool-a" in contents


def entries_of(*documents: dict) -> dict[str, bytes]:
    return desired_entries(registry_of(*documents))


# (case id, bucket now, input, refusal reason or None)
GUARD_CASES = [
    ("empty input over pools", (pool(), model()), (), "no_pools"),
    ("empty input over an empty bucket", (), (), None),
    ("one of two pools removed", (pool(), pool("pool-b")), (pool(),), None),
    ("a pool's endpoints emptied", (pool(), pool("pool-b")), (pool(), pool("pool-b", endpoints=0)),
     "no_endpoints"),
    ("a pool's endpoint list removed", (pool(),), (
        {**pool(), "spec": {k: v for k, v in pool()["spec"].items() if k != "endpoints"}},),
     "no_endpoints"),
    ("some endpoints removed", (pool(endpoints=3),), (pool(endpoints=1),), None),
    ("a pool removed with its endpoints", (pool(), pool("pool-b")), (pool("pool-b"),), None),
    ("a pool that had no endpoints stays empty", (pool(endpoints=0),), (pool(endpoints=0),), None),
    ("every model removed", (pool(), model()), (pool(),), None),
]


@pytest.mark.parametrize(("now", "new", "reason"), [case[1:] for case in GUARD_CASES],
                         ids=[case[0] for case in GUARD_CASES])
def test_removal_guard_refuses_only_emptying_every_pool_or_a_pools_endpoints(
    now: tuple[dict, ...], new: tuple[dict, ...], reason: str | None
) -> None:
    current = entries_of(*now) if now else {}
    desired = entries_of(*new) if new else {}
    refusal = removal_refusal(desired, current)
    assert (refusal.reason if refusal else None) == reason


def test_removal_refusal_names_the_pools_shortly() -> None:
    current = entries_of(*(pool(f"pool-{i}") for i in range(12)))
    refusal = removal_refusal({}, current)
    assert refusal is not None
    assert "every pool (pool-0, pool-1, pool-10, pool-11, pool-2 and 7 more)" in refusal.message
    undecodable = {**entries_of(pool()), "endpoints.pool-a": b"\xc1not msgpack"}
    assert removal_refusal(entries_of(pool(endpoints=0)), undecodable) is None


async def test_publish_that_would_empty_the_registry_writes_nothing_unless_allowed(
    nc: Client,
) -> None:
    publisher = Publisher(nc.jetstream(), BUCKET)
    await publisher.publish(registry_of(pool(), model()))
    before = await bucket_contents(nc)

    with pytest.raises(RemovalRefused) as refused:
        await publisher.publish(Registry())
    assert refused.value.refusal.reason == "no_pools"
    with pytest.raises(RemovalRefused) as refused:
        await publisher.publish(registry_of(pool(endpoints=0), model()))
    assert refused.value.refusal.reason == "no_endpoints"
    assert await bucket_contents(nc) == before

    done = await publisher.publish(Registry(), allow_empty=True)
    assert done.deletes == ("model.pool-a.model-a", "endpoints.pool-a", "pool.pool-a")
    assert await bucket_contents(nc) == {}
    again = await publisher.publish(Registry())  # nothing left to lose: allowed
    assert (again.puts, again.deletes) == ((), ())
