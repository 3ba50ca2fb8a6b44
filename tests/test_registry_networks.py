"""Endpoints outside a pool's allowed networks are refused by the registry (pure, no NATS): a
poisoned input cannot send prompts to the node itself, the cloud metadata service or the
internet."""

from __future__ import annotations

from typing import Any

import pytest

from services.registry.files import FileSnapshot, SourceFile, load
from services.registry.loader import InvalidRegistry, Problem
from tests.support.registry_yaml import dump, model, pool


def pool_at(*addresses: str, **spec: Any) -> dict[str, Any]:
    document = pool(endpoints=0, **spec)
    document["spec"]["endpoints"] = [{"name": f"pod-{i}", "address": address}
                                     for i, address in enumerate(addresses)]
    return document


def loads(document: dict[str, Any]) -> bool:
    load(FileSnapshot((SourceFile("r.yaml", dump(document, model())),)))
    return True


def problems(document: dict[str, Any]) -> list[Problem]:
    with pytest.raises(InvalidRegistry) as caught:
        loads(document)
    return list(caught.value.problems)


@pytest.mark.parametrize("address", ["10.1.2.3", "172.20.0.5", "192.168.1.1", "100.64.0.9",
                                     "fd00::1"])
def test_private_addresses_are_allowed_by_default(address: str) -> None:
    assert loads(pool_at(address))


@pytest.mark.parametrize("address, why", [
    ("127.0.0.1", "is a loopback address"),
    ("::1", "is a loopback address"),
    ("169.254.169.254", "is a link-local address"),  # the cloud metadata service
    ("8.8.8.8", "is outside the default allowed networks"),
    ("0.0.0.0", "is the unspecified address"),
    ("224.0.0.1", "is a multicast address"),
])
def test_other_addresses_are_refused_by_default(address: str, why: str) -> None:
    found = problems(pool_at("10.0.0.1", address))
    assert [(p.field, why in p.message) for p in found] == [("spec.endpoints[1].address", True)]
    assert "r.yaml" in str(found[0]) and "document 1" in str(found[0])


def test_the_pool_lists_its_networks() -> None:
    assert loads(pool_at("203.0.113.7", allowedNetworks=["203.0.113.0/24"]))
    found = problems(pool_at("10.0.0.1", allowedNetworks=["203.0.113.0/24"]))
    assert "outside spec.allowedNetworks" in found[0].message


def test_loopback_only_when_listed_explicitly() -> None:
    assert loads(pool_at("127.0.0.1", allowedNetworks=["127.0.0.0/8"]))
    # A broad network does not admit loopback or link-local addresses.
    for address in ("127.0.0.1", "169.254.169.254"):
        found = problems(pool_at(address, allowedNetworks=["0.0.0.0/0"]))
        assert "list a" in found[0].message, found
    assert loads(pool_at("169.254.10.1", allowedNetworks=["169.254.0.0/16"]))
    assert loads(pool_at("::1", allowedNetworks=["::1/128"]))


def test_bad_networks_are_named() -> None:
    found = problems(pool_at("10.0.0.1", allowedNetworks=["10.0.0.0/8", "10.0.0.1/8", "nope"]))
    assert [p.field for p in found] == ["spec.allowedNetworks[1]", "spec.allowedNetworks[2]"]
    assert "host bits set" in found[0].message
