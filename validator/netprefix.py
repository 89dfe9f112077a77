"""The network a source address belongs to: what the grant server's per-network limits count.

Keys are free and one machine has many of them, so the grant desk and server ration by network:
an IPv4 address by its /24, an IPv6 address by its /48 (what one site is usually given) by
default; an IPv4-mapped IPv6 address counts as its IPv4 address::

    network_prefix("203.0.113.7")          # "203.0.113.0/24"
    network_prefix("2001:db8:1:2::5")      # "2001:db8:1::/48"
"""

from __future__ import annotations

import ipaddress

__all__ = ["network_prefix"]


def network_prefix(address: str, v4_bits: int = 24, v6_bits: int = 48) -> str:
    """The network of ``address`` (``v4_bits``/``v6_bits`` long); ``address`` itself when it is
    not an IP address (a Unix socket, an empty peer name)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    bits = v4_bits if ip.version == 4 else v6_bits
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))
