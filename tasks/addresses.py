"""Which addresses outbound requests (tasks/egress.py) may reach: public unicast only.

An address is public when it is in no block of IANA's special-purpose registries that is not
globally reachable (IPv4: RFC 6890 and its updates; IPv6: the same, plus what lies outside
global unicast 2000::/3), is not multicast, and Python's own `is_global` agrees. The
registries are copied below rather than left to `ipaddress`, whose lists differ between
Python releases (3.11 counts 192.0.0.8, ::127.0.0.1 and 64:ff9b:1::/48 as global).

IPv6 addresses that carry an IPv4 address the network may route to are unwrapped, and the
IPv4 address inside is what is checked: IPv4-mapped (::ffff:a.b.c.d), IPv4-translated
(::ffff:0:a.b.c.d), IPv4-compatible (::a.b.c.d), NAT64's well-known prefix (64:ff9b::/96)
and 6to4 (2002:AABB:CCDD::/48). Local-use NAT64 (64:ff9b:1::/48) translates into the local
network and Teredo (2001::/32, inside 2001::/23) is not globally reachable: both are
refused whatever they carry.
"""
from __future__ import annotations

import ipaddress
from typing import Union

Address = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]

# IANA IPv4 Special-Purpose Address Registry: the blocks not globally reachable, and the
# limited broadcast address; multicast (224.0.0.0/4) is refused separately.
_IPV4_SPECIAL = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8",        # "this network"
    "10.0.0.0/8",       # private
    "100.64.0.0/10",    # shared address space (carrier-grade NAT)
    "127.0.0.0/8",      # loopback
    "169.254.0.0/16",   # link-local (cloud metadata services)
    "172.16.0.0/12",    # private
    "192.0.0.0/24",     # IETF protocol assignments (192.0.0.8 dummy, DS-Lite, NAT64 discovery)
    "192.0.2.0/24",     # documentation (TEST-NET-1)
    "192.88.99.0/24",   # 6to4 relay anycast, deprecated
    "192.168.0.0/16",   # private
    "198.18.0.0/15",    # benchmarking
    "198.51.100.0/24",  # documentation (TEST-NET-2)
    "203.0.113.0/24",   # documentation (TEST-NET-3)
    "240.0.0.0/4",      # reserved
    "255.255.255.255/32",  # limited broadcast
))

# Inside global unicast (2000::/3), the IPv6 registry's blocks that are not globally
# reachable. Everything outside 2000::/3 is refused, but for the IPv4-carrying forms below.
_IPV6_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")
_IPV6_SPECIAL = tuple(ipaddress.ip_network(n) for n in (
    "2001::/23",        # IETF protocol assignments, Teredo (2001::/32) and ORCHID included
    "2001:db8::/32",    # documentation
    "3fff::/20",        # documentation
))

_MAPPED = ipaddress.ip_network("::ffff:0:0/96")       # IPv4-mapped
_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")  # IPv4-translated (SIIT)
_COMPATIBLE = ipaddress.ip_network("::/96")           # IPv4-compatible, deprecated
_NAT64 = ipaddress.ip_network("64:ff9b::/96")         # NAT64, well-known prefix
_SIX_TO_FOUR = ipaddress.ip_network("2002::/16")      # 6to4: the IPv4 address in bits 16-47


def embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries, for the forms that carry one."""
    if any(ip in net for net in (_MAPPED, _TRANSLATED, _NAT64)):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip in _COMPATIBLE and int(ip) > 1:  # :: and ::1 are not IPv4-compatible addresses
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip in _SIX_TO_FOUR:
        return ipaddress.IPv4Address((int(ip) >> 80) & 0xFFFFFFFF)
    return None


def is_public(ip: Address) -> bool:
    """Whether `ip` is a public unicast address, or an IPv6 form of one (module docstring)."""
    if ip.is_multicast:
        return False
    if isinstance(ip, ipaddress.IPv4Address):
        return ip.is_global and not any(ip in net for net in _IPV4_SPECIAL)
    inner = embedded_ipv4(ip)
    if inner is not None:
        return is_public(inner)
    return (ip in _IPV6_GLOBAL_UNICAST and ip.is_global
            and not any(ip in net for net in _IPV6_SPECIAL))
