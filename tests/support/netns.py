"""A network namespace joined to this host by a veth pair, for a process whose network can be
cut (iptables DROP, both ways, inside the namespace) and restored while everything else runs
on. Made and removed by the test that uses it, even when the test fails (`namespace`)."""
from __future__ import annotations

import secrets
import subprocess
from contextlib import contextmanager
from typing import Iterator

from tests.support.tools import require

_RULES = (("INPUT", "-i"), ("OUTPUT", "-o"))


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Namespace:
    def __init__(self, name: str, host_if: str, ns_if: str, subnet: int) -> None:
        self.name, self.host_if, self.ns_if = name, host_if, ns_if
        self.host_address = f"10.231.{subnet}.1"  # this host, as the namespace reaches it
        self.address = f"10.231.{subnet}.2"

    @property
    def prefix(self) -> list[str]:
        """Run a command inside: prepend this."""
        return ["ip", "netns", "exec", self.name]

    def _rules(self, action: str) -> None:
        """Both rules in one `iptables-restore`: one process, and both directions at once."""
        rules = "".join(f"{action} {chain} {direction} {self.ns_if} -j DROP\n"
                        for chain, direction in _RULES)
        subprocess.run([*self.prefix, "iptables-restore", "--noflush"],
                       input=f"*filter\n{rules}COMMIT\n", text=True, check=True,
                       capture_output=True, timeout=30)

    def cut(self) -> None:
        """Every packet between the namespace and the host dropped, both ways: connections
        stay open and silent, as on a network that went away."""
        self._rules("-A")

    def restore(self) -> None:
        self._rules("-D")


@contextmanager
def namespace() -> Iterator[Namespace]:
    require("iptables")
    tag = secrets.token_hex(3)
    ns = Namespace(f"iqt-{tag}", f"iqh{tag}", f"iqn{tag}", int(tag[:2], 16))
    try:
        _ip("netns", "add", ns.name)
        _ip("link", "add", ns.host_if, "type", "veth", "peer", "name", ns.ns_if)
        _ip("link", "set", ns.ns_if, "netns", ns.name)
        _ip("addr", "add", f"{ns.host_address}/30", "dev", ns.host_if)
        _ip("link", "set", ns.host_if, "up")
        _ip("netns", "exec", ns.name, "ip", "addr", "add", f"{ns.address}/30", "dev", ns.ns_if)
        _ip("netns", "exec", ns.name, "ip", "link", "set", ns.ns_if, "up")
        _ip("netns", "exec", ns.name, "ip", "link", "set", "lo", "up")
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns.name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", ns.host_if], capture_output=True, timeout=30)
