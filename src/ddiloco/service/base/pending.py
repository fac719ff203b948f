"""Connections that have not started their handshake: bounded in number and in age.

ZeroMQ accepts every TCP connection to the syncer's ROUTER and holds a file descriptor (and an
engine) for it until its handshake completes or ``ZMQ_HANDSHAKE_IVL`` runs out; it has no bound
on how many may wait. A peer without a key can therefore open thousands of idle connections
(9,949 halved the honest merge rate and took 8,500 descriptors, issue 34). ``PendingGate``
watches the ROUTER's accepted connections (ZeroMQ's socket monitor gives each one's descriptor)
and the bytes each has received (the kernel's ``TCP_INFO``): a connection whose peer has not
sent the first command of a handshake (``first_bytes``: the ZMTP greeting plus the mechanism's
first command, what an honest peer sends at once) within ``grace_s`` is cut, and beyond
``max_pending`` such connections the oldest are cut at once. Cutting is ``shutdown(2)`` on a
duplicate of the descriptor: ZeroMQ sees the connection end and closes its own descriptor.

A descriptor that ZeroMQ closed may be handed by the kernel to another socket before its monitor
event is read: each one is known by its (local, peer) addresses from when it was accepted (its
local port must be the listening one), and one whose addresses differ since is forgotten, never
cut (in the syncer's own process a client socket, say the evaluation hook's, may take it). A
descriptor that is no TCP socket any more is forgotten too.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator

TCPI_BYTES_RECEIVED = 128
"""Offset of ``tcpi_bytes_received`` (u64) in Linux's ``struct tcp_info`` (since Linux 4.1)."""
GREETING = 64
"""The ZMTP 3 greeting's bytes."""
FIRST_COMMAND = {"curve": 200, "null": 27}
"""The first handshake command's bytes: CURVE's HELLO, or NULL's READY with no properties."""


@contextlib.contextmanager
def _borrowed(fd: int) -> Iterator[socket.socket | None]:
    """A socket on a duplicate of ``fd`` for one look (None: ``fd`` is no socket any more);
    closing the duplicate leaves ``fd`` to its owner."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        yield None
        return
    with dup:
        yield dup


def bytes_received(fd: int) -> int | None:
    """Payload bytes the kernel has received on TCP socket ``fd`` (None: no TCP socket, or gone)."""
    with _borrowed(fd) as s:
        if s is None or s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        try:
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCPI_BYTES_RECEIVED + 8)
        except OSError:
            return None
        if len(info) < TCPI_BYTES_RECEIVED + 8:
            return None
        return int(struct.unpack_from("<Q", info, TCPI_BYTES_RECEIVED)[0])


def identity(fd: int) -> tuple[object, object] | None:
    """(local address, peer address) of TCP socket ``fd`` (None: no connected socket)."""
    with _borrowed(fd) as s:
        try:
            return None if s is None else (s.getsockname(), s.getpeername())
        except OSError:
            return None


def cut(fd: int) -> bool:
    """End TCP connection ``fd`` (its owner sees it closed and lets its descriptor go)."""
    with _borrowed(fd) as s:
        if s is None:
            return False
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
        return True


class PendingGate:
    """The accepted connections that have not yet sent a handshake's first command (pure but
    for the three calls it is given: ``received(fd)``, ``identify(fd)`` and ``cut(fd)``)."""

    def __init__(
        self,
        max_pending: int,
        grace_s: float,
        first_bytes: int,
        received: Callable[[int], int | None] = bytes_received,
        cutter: Callable[[int], bool] = cut,
        identify: Callable[[int], object | None] = identity,
        port: int | None = None,
    ) -> None:
        """``port``: the listening port; a descriptor whose local port is another is no
        connection accepted there (the descriptor was reused at once) and is left alone."""
        self.max_pending, self.grace_s, self.first_bytes = max_pending, grace_s, first_bytes
        self._received, self._cut, self._identify, self.port = received, cutter, identify, port
        self._pending: OrderedDict[int, tuple[float, object]] = OrderedDict()
        """Descriptor -> (when it was accepted, its identity then), oldest first: a descriptor
        whose identity has changed since was reused, and is forgotten, never cut."""
        self.cut_count = 0
        """Connections cut (too many waiting, or silent past the grace)."""

    def accepted(self, fd: int, now: float) -> None:
        self._pending.pop(fd, None)  # a descriptor reused: the new connection's clock
        who = self._identify(fd)
        if who is None or (self.port is not None and _port_of(who) != self.port):
            return  # gone already, or reused by a connection that was not accepted here
        self._pending[fd] = (now, who)

    def closed(self, fd: int) -> None:
        self._pending.pop(fd, None)

    def pending(self) -> int:
        """Connections accepted that have not been seen to start their handshake."""
        return len(self._pending)

    def check(self, now: float) -> int:
        """Forget the connections that started their handshake, cut the silent ones past the
        grace and, beyond ``max_pending``, the oldest silent ones; returns how many were cut."""
        silent = []
        for fd, (_, who) in list(self._pending.items()):
            got = self._received(fd)
            if got is None or got >= self.first_bytes or self._identify(fd) != who:
                del self._pending[fd]  # started (ZeroMQ's handshake timeout bounds the rest), or no TCP socket
            else:
                silent.append(fd)
        excess, cuts = len(silent) - self.max_pending, 0
        for i, fd in enumerate(silent):  # oldest first
            if i < excess or now - self._pending[fd][0] >= self.grace_s:
                del self._pending[fd]
                cuts += self._cut(fd)
        self.cut_count += cuts
        return cuts


def _port_of(who: object) -> int | None:
    """The local port of an ``identity`` (None: not one)."""
    if isinstance(who, tuple) and who and isinstance(who[0], tuple) and len(who[0]) >= 2:
        port = who[0][1]
        return port if isinstance(port, int) else None
    return None
