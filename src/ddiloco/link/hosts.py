"""Emulated hosts on one machine: a Linux network namespace per process, joined by veth pairs
to a bridge, each host's rate from the kernel (a ``tbf`` qdisc on both ends of its veth pair).

Delay, jitter and faults stay in user space (the kernel's ``netem`` is often missing): run the
project's relay (``ddiloco link``) inside the listening host's namespace, listening on that
host's address and forwarding to the server there, as ``chaos.links`` plans it on loopback.
Every process then binds its own host's address, and bytes between hosts cross a real kernel
link with its own queue and rate.

Needs root (or CAP_NET_ADMIN) and ``ip``/``tc`` (iproute2); ``unavailable()`` says why not. Names
carry the harness's process id (``ddl<PID>-...``), so ``EmulatedHosts.up`` first deletes what a
crashed harness left (namespaces of a process that is gone), and ``down`` (also on exit from
the ``with`` block) deletes its own: nothing is left behind but what a live harness holds.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "ddl"
"""Namespace names are PREFIX + the harness's pid + "-" + a host's index (or "hub")."""
_OURS = re.compile(rf"^{PREFIX}(\d+)-(\w+)$")
MAX_HOSTS = 250
"""Hosts in one /24 (the bridge side needs no address)."""


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


def _tc(ns: str, *args: str) -> None:
    argv = ["ip", "netns", "exec", ns, "tc", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")


def unavailable() -> str | None:
    """Why emulated hosts cannot be made here (None: they can): one line."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, veth pairs and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"emulated hosts need `{tool}` (Debian: apt-get install iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"this machine cannot make network namespaces: {made.stderr.strip()}"
        pair = _ip("link", "add", "name", "pa", "type", "veth", "peer", "name", "pb", ns=probe, check=False)
        if pair.returncode != 0:
            return f"this machine cannot make veth pairs: {pair.stderr.strip()}"
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"emulated hosts cannot be made here: {e}"
    finally:
        _ip("netns", "delete", probe, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete the namespaces of harnesses that are gone; the names deleted."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    gone = []
    for line in listed:
        name = line.split(" ")[0]
        m = _OURS.match(name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            _ip("netns", "delete", name, check=False)
            gone.append(name)
    if gone:
        log.info("removed %d network namespaces left by a harness that is gone", len(gone))
    return gone


def _both_ways(rate: float | tuple[float, float]) -> tuple[float, float]:
    if isinstance(rate, tuple):
        return float(rate[0]), float(rate[1])
    return float(rate), float(rate)


def namespace_addresses(ns: str) -> set[str]:
    """The local addresses of every TCP socket in network namespace ``ns`` (``ss`` inside it)."""
    done = subprocess.run(["ip", "netns", "exec", ns, "ss", "-Htan"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ss in {ns}: {done.stderr.strip() or done.returncode}")
    out = set()
    for line in done.stdout.splitlines():
        cols = line.split()
        if len(cols) >= 4:  # State Recv-Q Send-Q Local:Port Peer:Port
            out.add(cols[3].rsplit(":", 1)[0].strip("[]"))
    return out


class EmulatedHosts:
    """Hosts by name, each a namespace with one address on a shared /24; ``up`` makes them,
    ``down`` deletes them (a context manager does both)."""

    def __init__(
        self,
        names: Sequence[str],
        rates_bps: Mapping[str, float | tuple[float, float]] | None = None,
        subnet: str = "10.213.0.0/24",
    ) -> None:
        """``rates_bps``: a host's rate in bits per second, one number for both ways or (what it
        sends, what it receives) (missing or 0: none); ``subnet``: a /24 of the hosts' addresses
        (keep it off the machine's own networks)."""
        net = ipaddress.ip_network(subnet)
        if net.prefixlen != 24 or not net.is_private:
            raise ValueError(f"subnet {subnet}: a private /24 (e.g. 10.213.0.0/24)")
        if not 0 < len(names) <= MAX_HOSTS or len(set(names)) != len(names):
            raise ValueError(f"1 to {MAX_HOSTS} distinct host names")
        self.names = list(names)
        given = rates_bps or {}
        self.rates = {n: _both_ways(given.get(n, 0.0)) for n in self.names}
        """Each host's (send, receive) rate in bits per second (0: none)."""
        if any(not 0 <= r < 1e12 for pair in self.rates.values() for r in pair):
            raise ValueError("rates are bits per second in [0, 1e12) (0: none)")
        hosts = list(net.hosts())
        self.addresses = {n: str(hosts[i]) for i, n in enumerate(self.names)}
        tag = f"{PREFIX}{os.getpid()}"
        self.hub = f"{tag}-hub"
        self.namespaces = {n: f"{tag}-{i}" for i, n in enumerate(self.names)}
        self.is_up = False

    def up(self) -> EmulatedHosts:
        remove_stale()
        try:
            _ip("netns", "add", self.hub)
            _ip("link", "add", "br0", "type", "bridge", ns=self.hub)
            _ip("link", "set", "br0", "up", ns=self.hub)
            for i, name in enumerate(self.names):
                self._host(i, name)
        except BaseException:
            self.down()
            raise
        self.is_up = True
        log.info("emulated hosts up: %s", ", ".join(f"{n} {self.addresses[n]}" for n in self.names))
        return self

    def _host(self, i: int, name: str) -> None:
        ns = self.namespaces[name]
        _ip("netns", "add", ns)
        _ip("link", "set", "lo", "up", ns=ns)
        # The pair is made in the hub, and one end moved into the host as its eth0.
        _ip("link", "add", f"p{i}", "type", "veth", "peer", "name", f"h{i}", ns=self.hub)
        _ip("link", "set", f"h{i}", "netns", ns, ns=self.hub)
        _ip("link", "set", f"h{i}", "name", "eth0", ns=ns)
        _ip("addr", "add", f"{self.addresses[name]}/24", "dev", "eth0", ns=ns)
        _ip("link", "set", "eth0", "up", ns=ns)
        _ip("link", "set", f"p{i}", "master", "br0", ns=self.hub)
        _ip("link", "set", f"p{i}", "up", ns=self.hub)
        send, receive = self.rates[name]
        # its sends (eth0 out) and what it receives (the hub's end out towards it)
        for where, dev, rate in ((ns, "eth0", send), (self.hub, f"p{i}", receive)):
            if rate > 0:
                burst = max(32 * 1024, int(rate / 8 / 100))  # 10 ms of bytes, at least 32 KiB
                _tc(where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(rate)}bit",
                    "burst", str(burst), "latency", "200ms")  # fmt: skip

    def address(self, name: str) -> str:
        """The host's address (what its processes bind and others connect to)."""
        return self.addresses[name]

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` to run on host ``name`` (in its namespace)."""
        return ["ip", "netns", "exec", self.namespaces[name], *argv]

    def popen(self, name: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on host ``name``."""
        return subprocess.Popen(self.command(name, argv), **kwargs)

    def local_addresses(self, name: str) -> set[str]:
        """The local addresses of every TCP socket on host ``name``, listening or connected (what
        its processes bound: its own address, or loopback for what stays inside it)."""
        return namespace_addresses(self.namespaces[name])

    def set_link(self, name: str, up: bool) -> None:
        """Cut host ``name`` off (a partition: its packets go nowhere, connections stall) or
        join it again."""
        i = self.names.index(name)
        _ip("link", "set", f"p{i}", "up" if up else "down", ns=self.hub)

    def down(self) -> None:
        """Delete every namespace of these hosts (their interfaces go with them); safe twice."""
        for ns in [*self.namespaces.values(), self.hub]:
            _ip("netns", "delete", ns, check=False)
        self.is_up = False

    def __enter__(self) -> EmulatedHosts:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()
