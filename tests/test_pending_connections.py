"""Connections that never start their handshake are bounded in number and age (issue 34, item 3).

The rule (``pending.PendingGate``) is tested with a fake kernel; the syncer's ROUTER with real
idle TCP connections on loopback (bounded in count and time; no timing assertions).
"""

from __future__ import annotations

import socket

import pytest
import zmq
from helpers import wait_for

from ddiloco.service.base.pending import PendingGate, bytes_received
from ddiloco.service.base.transport import ZmqSyncerSocket
from ddiloco.service.ops.launcher import free_port


class FakeKernel:
    def __init__(self) -> None:
        self.got: dict[int, int | None] = {}
        self.cuts: list[int] = []
        self.who: dict[int, object] = {}

    def received(self, fd: int) -> int | None:
        return self.got.get(fd, 0)

    def cut(self, fd: int) -> bool:
        self.cuts.append(fd)
        return True

    def identify(self, fd: int) -> object | None:
        return self.who.get(fd, ((f"10.0.0.{fd}", 5555), ("peer", fd)))


def test_silent_connections_beyond_the_bound_go_oldest_first_and_the_rest_after_the_grace():
    k = FakeKernel()
    gate = PendingGate(3, 10.0, 264, received=k.received, cutter=k.cut, identify=k.identify, port=5555)
    for fd in range(10, 16):
        gate.accepted(fd, now=float(fd - 10))
    k.got[14] = 300  # started its handshake: never cut, forgotten
    k.got[11] = None  # no TCP socket any more: forgotten, never touched
    k.who[9] = (("10.0.0.9", 6000), ("peer", 9))
    assert gate.check(5.5) == 1 and k.cuts == [10]  # 4 silent > 3: the oldest goes, within its grace
    assert gate.pending() == 3  # 12, 13, 15
    assert gate.check(11.9) == 0
    assert gate.check(13.0) == 2 and k.cuts == [10, 12, 13]  # 10 s silent: past the grace
    gate.closed(15)
    assert gate.pending() == 0 and gate.cut_count == 3
    gate.accepted(7, 30.0)
    gate.accepted(7, 40.0)  # a descriptor reused: the new connection's clock
    assert gate.check(49.0) == 0 and gate.check(50.0) == 1
    gate.accepted(8, 60.0)
    k.who[8] = (("10.0.0.8", 40000), ("syncer", 5555))  # reused meanwhile by a client socket of the process
    assert gate.check(99.0) == 0 and gate.pending() == 0 and 8 not in k.cuts
    gate.accepted(9, 100.0)  # accepted elsewhere (another local port): not this listener's
    assert gate.pending() == 0


def test_bytes_received_reads_the_kernels_count_and_is_none_for_what_is_no_tcp_socket():
    host = "127.0.0.1"
    server = socket.create_server((host, 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    try:
        client.sendall(b"x" * 100)
        assert wait_for(lambda: bytes_received(peer.fileno()) == 100, 30, "the kernel to count 100 bytes")
        r, w = socket.socketpair(socket.AF_UNIX)
        assert bytes_received(r.fileno()) is None and bytes_received(10**6) is None
        r.close()
        w.close()
    finally:
        for s in (client, peer, server):
            s.close()


@pytest.mark.parametrize("keyed", [False, True])
def test_idle_connections_to_the_syncer_are_cut_and_an_honest_peer_is_served_throughout(tmp_path, keyed):
    """40 connections that send nothing, against a bound of 8 and a grace of 1 s: the syncer
    keeps at most 8 of them waiting and cuts them all in the end, while a peer that speaks
    ZeroMQ (with a key when the syncer wants keys) is answered."""
    from ddiloco.service.base.keys import ClientKeys, ServerKeys, make_keys

    host = "127.0.0.7"
    addr = f"tcp://{host}:{free_port(host)}"
    keys = None
    if keyed:
        make_keys(tmp_path / "keys", learners=1)
        keys = ServerKeys.load(tmp_path / "keys")
    server = ZmqSyncerSocket(addr, keys=keys, max_pending=8, pending_s=1.0)
    idle: list[socket.socket] = []
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        for _ in range(40):
            s = socket.create_connection((host, int(addr.rsplit(":", 1)[1])), timeout=30)
            s.setblocking(False)
            idle.append(s)
        if keyed:
            ClientKeys.load(tmp_path / "keys", "learner-0").apply(dealer)
        dealer.connect(addr)
        dealer.send_multipart([b"hello"])
        got: list = []
        ended: set[int] = set()

        def served_and_all_cut() -> bool:
            got.extend(server.recv(0.05, 10))
            # after each look (those between are the bound plus what arrived since): +1, the peer's until it speaks
            assert server.counts["connections_pending"] <= 8 + 1
            for i, s in enumerate(idle):
                if i in ended:
                    continue
                try:
                    while data := s.recv(4096):
                        del data  # ZeroMQ's greeting: not an end
                    ended.add(i)  # b"": the syncer closed it
                except BlockingIOError:
                    pass
                except OSError:
                    ended.add(i)  # reset: cut
            return bool(got) and len(ended) == len(idle)

        wait_for(served_and_all_cut, 60, "the honest peer served and every idle connection cut")
        assert got[0].frames[-1].bytes == b"hello"
        assert server.counts["connections_cut"] >= 40 - 8
        identity = got[0].identity
        assert server.send(identity, [b"back"])
        assert dealer.poll(30_000) and dealer.recv_multipart() == [b"back"]
    finally:
        for s in idle:
            s.close()
        dealer.close(0)
        server.close()
