"""A node's multiaddrs: the ones it can be reached at, which of them are loopback or public, and the
ones it announces in its records."""

from __future__ import annotations

import ipaddress

from hivemind.dht import DHT


def visible_maddrs(dht: DHT) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs()]


def is_loopback(maddr: str) -> bool:
    ip = _ip_of(maddr)
    return ip is not None and ip.is_loopback


def is_public(maddr: str) -> bool:
    ip = _ip_of(maddr)
    return ip is not None and ip.is_global


def _ip_of(maddr: str):

    parts = maddr.split("/")
    for proto in ("ip4", "ip6"):
        if proto in parts:
            try:
                return ipaddress.ip_address(parts[parts.index(proto) + 1])
            except (ValueError, IndexError):
                return None
    return None


def announced_maddrs(dht: DHT) -> list[str]:
    """The multiaddrs (with /p2p/) other hosts should dial: what the node announces, without its
    loopback addresses when it has any other (a server listening on 0.0.0.0 also shows 127.0.0.1)."""
    maddrs = visible_maddrs(dht)
    outside = [m for m in maddrs if not is_loopback(m)]
    return outside or maddrs
