"""Which addresses a pool's endpoints may have (``InferencePool.spec.allowedNetworks``).

The registry decides where prompts go, so a poisoned input must not be able to send them
anywhere. Every endpoint address must lie in one of the pool's allowed networks (CIDRs); without
``allowedNetworks`` the private ranges are allowed (:data:`DEFAULT_ALLOWED_NETWORKS`: where pods
live). Loopback and link-local addresses (the node itself; ``169.254.169.254`` is the cloud
metadata service) are allowed only by a listed network that is itself loopback or link-local,
never by a broad one such as ``0.0.0.0/0``. Unspecified and multicast addresses are never
endpoints.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

DEFAULT_ALLOWED_NETWORKS = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
                            "fc00::/7")


def parse_networks(cidrs: Sequence[str]) -> tuple[list[IPNetwork], list[tuple[int, str]]]:
    """The networks, and ``(index, message)`` for each entry that is not a CIDR."""
    networks: list[IPNetwork] = []
    problems: list[tuple[int, str]] = []
    for i, cidr in enumerate(cidrs):
        try:
            networks.append(ipaddress.ip_network(cidr, strict=True))
        except ValueError as exc:
            problems.append((i, f"{cidr!r} is not a network in CIDR notation ({exc})"))
    return networks, problems


def _special(address: IPAddress | IPNetwork) -> str | None:
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    return None


def refusal(address: str, networks: Sequence[IPNetwork], explicit: bool,
            setting: str = "spec.allowedNetworks") -> str | None:
    """Why ``address`` may not be an endpoint under ``networks`` (None when it may).

    ``explicit`` says whether the networks were listed by the pool or are the defaults, and
    ``setting`` where they are listed (both only word the message).
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None  # not an IP at all: reported by the address check itself
    if ip.is_unspecified or ip.is_multicast:
        return f"{address} is not a host address"
    kind = _special(ip)
    for network in networks:
        if ip.version == network.version and ip in network and (
                kind is None or _special(network) == kind):
            return None
    where = setting if explicit else (
        "the default allowed networks " + ", ".join(DEFAULT_ALLOWED_NETWORKS))
    if kind is not None:
        return (f"{address} is a {kind} address; list a {kind} network in {setting} "
                f"(e.g. {'127.0.0.0/8' if kind == 'loopback' else '169.254.0.0/16'}) to allow it")
    return f"{address} is outside {where}"
