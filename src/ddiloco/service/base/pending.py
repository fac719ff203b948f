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

A descriptor that ZeroMQ closed and the kernel handed to a new connection before its monitor
event was read may be taken for the old one: the new connection is cut only if it too has sent
nothing for ``grace_s`` (an honest peer sends its greeting on connect), and a ZeroMQ peer
reconnects by itself. A descriptor that is no TCP socket any more is forgotten, never touched.
"""

from __future__ import annotations

import os
import socket
import struct
from collections import OrderedDict
from collections.abc import Callable

TCPI_BYTES_RECEIVED = 128
"""Offset of ``tcpi_bytes_received`` (u64) in Linux's ``struct tcp_info`` (since Linux 4.1)."""
GREETING = 64
"""The ZMTP 3 greeting's bytes."""
FIRST_COMMAND = {"curve": 200, "null": 27}
"""The first handshake command's bytes: CURVE's HELLO, or NULL's READY with no properties."""


def bytes_received(fd: int) -> int | None:
    """Payload bytes the kernel has received on TCP socket ``fd`` (None: no TCP socket, or gone)."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if dup.type != socket.SOCK_STREAM or dup.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        info = dup.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCPI_BYTES_RECEIVED + 8)
        if len(info) < TCPI_BYTES_RECEIVED + 8:
            return None
        return int(struct.unpack_from("<Q", info, TCPI_BYTES_RECEIVED)[0])
    except OSError:
        return None
    finally:
        dup.close()


def cut(fd: int) -> bool:
    """End TCP connection ``fd`` (its owner sees it closed and lets its descriptor go)."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        dup.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        dup.close()


class PendingGate:
    """The accepted connections that have not yet sent a handshake's first command (pure but
    for the two calls it is given: ``received(fd)`` and ``cut(fd)``)."""

    def __init__(
        self,
        max_pending: int,
        grace_s: float,
        first_bytes: int,
        received: Callable[[int], int | None] = bytes_received,
        cutter: Callable[[int], bool] = cut,
    ) -> None:
        self.max_pending, self.grace_s, self.first_bytes = max_pending, grace_s, first_bytes
        self._received, self._cut = received, cutter
        self._pending: OrderedDict[int, float] = OrderedDict()
        """Descriptor -> when it was accepted, oldest first."""
        self.cut_count = 0
        """Connections cut (too many waiting, or silent past the grace)."""

    def accepted(self, fd: int, now: float) -> None:
        self._pending.pop(fd, None)  # a descriptor reused: the new connection's clock
        self._pending[fd] = now

    def closed(self, fd: int) -> None:
        self._pending.pop(fd, None)

    def pending(self) -> int:
        """Connections accepted that have not been seen to start their handshake."""
        return len(self._pending)

    def check(self, now: float) -> int:
        """Forget the connections that started their handshake, cut the silent ones past the
        grace and, beyond ``max_pending``, the oldest silent ones; returns how many were cut."""
        silent = []
        for fd in list(self._pending):
            got = self._received(fd)
            if got is None or got >= self.first_bytes:
                del self._pending[fd]  # started (ZeroMQ's handshake timeout bounds the rest), or no TCP socket
            else:
                silent.append(fd)
        excess, cuts = len(silent) - self.max_pending, 0
        for i, fd in enumerate(silent):  # oldest first
            if i < excess or now - self._pending[fd] >= self.grace_s:
                del self._pending[fd]
                cuts += self._cut(fd)
        self.cut_count += cuts
        return cuts
