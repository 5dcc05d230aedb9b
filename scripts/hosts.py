"""Hosts of their own on this machine, for workers that reach Redis over a network hop (the
fault tests, tests/faults/test_hosts.py, and the game day's host cut, bench/gameday): each
host is a network namespace (and a UTS namespace, for its own host name) joined to the root
namespace, where Redis and the API run, by a veth pair on a /30 of its own. A host can be cut
off (iptables drops every packet, both ways, as a partition does: connections hang rather than
reset) and healed, or slowed (tc netem, where the kernel has it); and its loopback ports can
lead to the root namespace's (`reach_loopback`), so that a process started there with the
same settings as the others (127.0.0.1 and a port) reaches the same Redis over the link.

`hosts(n)` is a context manager: whatever it made is removed when the block ends, also when a
test or a run fails. `unavailable()` says why the machine cannot make hosts (for a skip)."""
from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=60)


def unavailable() -> str | None:
    """Why hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not (shutil.which("ip") and shutil.which("unshare")):
        return "iproute2's `ip` or util-linux's `unshare` is missing"
    if not shutil.which("iptables"):
        return "iptables is missing (Debian's iptables; make test installs it as root)"
    probe = f"iqprobe{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    try:
        drop = _run("ip", "netns", "exec", probe, "iptables", "-A", "OUTPUT", "-j", "DROP",
                    check=False)
        if drop.returncode != 0:
            return f"iptables does not work in a namespace: {drop.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def netem_unavailable() -> str | None:
    """Why latency cannot be added here (this sandbox's kernel has no netem), or None."""
    probe = f"iqnetem{os.getpid()}"  # a veth pair, as the hosts' links are (dummy may be absent)
    _run("ip", "link", "add", probe, "type", "veth", "peer", "name", f"{probe}p", check=False)
    try:
        added = _run("tc", "qdisc", "add", "dev", probe, "root", "netem", "delay", "5ms",
                     check=False)
        return None if added.returncode == 0 else \
            f"tc netem is not available: {added.stderr.strip() or added.stdout.strip()}"
    finally:
        _run("ip", "link", "del", probe, check=False)


@dataclass
class Host:
    name: str      # its namespace, and its host name
    address: str   # its side of the veth pair
    gateway: str   # the root namespace's side: where Redis listens for it
    device: str    # its veth device (in the namespace)

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run on this host: in its namespace, under its own host name."""
        return ["ip", "netns", "exec", self.name, "unshare", "--uts", "sh", "-c",
                f'hostname {self.name} && exec "$@"', "sh", *argv]

    def _in(self, *cmd: str) -> None:
        _run("ip", "netns", "exec", self.name, *cmd)

    def cut(self) -> None:
        """Every packet to or from the host dropped, silently."""
        self._in("iptables", "-I", "INPUT", "-j", "DROP")
        self._in("iptables", "-I", "OUTPUT", "-j", "DROP")

    def heal(self) -> None:
        """The cut undone (the filter table flushed; `reach_loopback`'s rules, in the nat
        table, stay)."""
        self._in("iptables", "-F")

    def reach_loopback(self, ports: list[int]) -> None:
        """A connection from the host to 127.0.0.1:<port>, for each of `ports`, goes over its
        link to the root namespace's side (`gateway`), where the server listens too: its
        destination rewritten to the gateway (loopback addresses may leave the host:
        route_localnet) and its source to the host's address, as though the host had dialled
        the gateway. A cut drops these packets as every other."""
        self._in("sysctl", "-q", "-w", "net.ipv4.conf.all.route_localnet=1")
        for start in range(0, len(ports), 15):  # multiport takes 15 ports a rule
            self._in("iptables", "-t", "nat", "-A", "OUTPUT", "-d", "127.0.0.1/32", "-p", "tcp",
                     "-m", "multiport", "--dports", ",".join(map(str, ports[start:start + 15])),
                     "-j", "DNAT", "--to-destination", self.gateway)
        self._in("iptables", "-t", "nat", "-A", "POSTROUTING", "-o", self.device, "-s",
                 "127.0.0.0/8", "-j", "SNAT", "--to-source", self.address)

    def delay(self, ms: float) -> None:
        """`ms` more on every packet leaving the host (tc netem)."""
        self._in("tc", "qdisc", "add", "dev", self.device, "root", "netem", "delay", f"{ms}ms")


@contextmanager
def hosts(count: int) -> Iterator[list[Host]]:
    """`count` hosts, each on 10.<a>.<b>.0/30 (<a> from this process's id, so that two test
    runs at once do not share addresses), removed afterwards whatever happens."""
    tag = os.getpid() % 100_000
    net = 100 + tag % 100
    made: list[Host] = []
    try:
        for i in range(1, count + 1):
            name, outer = f"iq{tag}h{i}", f"iq{tag}r{i}"
            host = Host(name, f"10.{net}.{i}.2", f"10.{net}.{i}.1", f"iq{tag}v{i}")
            _run("ip", "netns", "add", name)
            made.append(host)
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", host.device)
            _run("ip", "link", "set", host.device, "netns", name)
            _run("ip", "addr", "add", f"{host.gateway}/30", "dev", outer)
            _run("ip", "link", "set", outer, "up")
            host._in("ip", "addr", "add", f"{host.address}/30", "dev", host.device)
            host._in("ip", "link", "set", host.device, "up")
            host._in("ip", "link", "set", "lo", "up")
        yield made
    finally:
        for host in made:
            # Deleting the namespace deletes its veth end, and with it the pair.
            _run("ip", "netns", "del", host.name, check=False)
            _run("ip", "link", "del", f"iq{tag}r{host.name.rsplit('h', 1)[1]}", check=False)
