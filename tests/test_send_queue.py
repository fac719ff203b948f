"""The syncer's send queue to each learner (issue 20, item 4): bounded in bytes, a newer version
of a fragment replaces the waiting older one, the oldest merged versions are dropped first and
counted, and order is kept. Plus the rule the service gives each message, and a ZeroMQ ROUTER
whose peer stops reading: our queue holds the backlog, bounded, instead of ZeroMQ's pipe."""

from __future__ import annotations

import torch

from ddiloco.core.messages import FragmentRequest, FragmentUpdate
from ddiloco.protocol.messages import JoinReply, SyncerHeartbeat
from ddiloco.service.base.transport import SendQueue, frames_bytes
from ddiloco.service.syncer.service import queue_rule

torch.set_num_threads(1)


def msg(tag: str, n: int) -> list[bytes]:
    """A two-frame message of ``n`` payload bytes, named by its header (16 bytes, so sizes match)."""
    return [tag.encode().ljust(16), bytes(n)]


def drain(q: SendQueue) -> list[str]:
    out = []
    while (frames := q.first()) is not None:
        out.append(bytes(frames[0]).decode().strip())
        q.pop_first()
    return out


def test_order_is_kept_and_bytes_are_counted() -> None:
    q = SendQueue(10_000)
    for tag in ("a", "b", "c"):
        assert q.put(msg(tag, 100))
    assert q.nbytes == 3 * 116 and len(q) == 3
    assert drain(q) == ["a", "b", "c"]
    assert q.nbytes == 0 and len(q) == 0


def test_a_newer_version_replaces_the_waiting_one_in_its_place() -> None:
    q = SendQueue(10_000)
    q.put(msg("p0v1", 100), key=("update", 0), droppable=True)
    q.put(msg("hb", 10))
    q.put(msg("p1v1", 100), key=("update", 1), droppable=True)
    assert q.put(msg("p0v2", 300), key=("update", 0), droppable=True)
    assert q.replaced == 1 and q.dropped == 0
    assert q.nbytes == frames_bytes(msg("p0v2", 300)) + frames_bytes(msg("hb", 10)) + frames_bytes(msg("p1v1", 100))
    assert drain(q) == ["p0v2", "hb", "p1v1"]  # v1 of fragment 0 is never sent


def test_a_sent_version_is_not_replaced() -> None:
    q = SendQueue(10_000)
    q.put(msg("p0v1", 100), key=("update", 0))
    assert drain(q) == ["p0v1"]
    q.put(msg("p0v2", 100), key=("update", 0))
    assert q.replaced == 0 and drain(q) == ["p0v2"]


def test_over_the_bound_the_oldest_droppable_go_first() -> None:
    size = frames_bytes(msg("x", 100))
    q = SendQueue(3 * size)
    q.put(msg("join0", 100), key=("update", 0), droppable=False)
    q.put(msg("m1", 100), key=("update", 1), droppable=True)
    q.put(msg("m2", 100), key=("update", 2), droppable=True)
    assert q.put(msg("m3", 100), key=("update", 3), droppable=True)
    assert q.dropped == 1 and q.dropped_bytes == size and q.nbytes == 3 * size
    assert drain(q) == ["join0", "m2", "m3"]  # m1 was the oldest droppable; the join's fragment stays


def test_undroppable_messages_are_kept_over_the_bound_and_a_droppable_that_cannot_fit_is_refused() -> None:
    size = frames_bytes(msg("x", 100))
    q = SendQueue(2 * size)
    for tag in ("j0", "j1", "j2"):
        assert q.put(msg(tag, 100), key=("update", tag), droppable=False)
    assert q.nbytes == 3 * size and q.dropped == 0
    assert not q.put(msg("m", 100), droppable=True)  # nothing older may go: the new one does
    assert q.dropped == 1
    assert drain(q) == ["j0", "j1", "j2"]


def test_replacing_keeps_the_stricter_flag() -> None:
    """A join's fragment replaced by a merged version stays undroppable: the learner needs it."""
    size = frames_bytes(msg("x", 100))
    q = SendQueue(size)
    q.put(msg("join-v1", 100), key=("update", 0), droppable=False)
    q.put(msg("merged-v2", 100), key=("update", 0), droppable=True)
    q.put(msg("m", 100), key=("update", 1), droppable=True)
    assert drain(q) == ["merged-v2"]
    assert q.dropped == 1


def test_the_service_rule_per_message() -> None:
    values = [torch.zeros(2)]
    merged = FragmentUpdate(1, 3, 7, values, 0.0, 1)
    assert queue_rule(merged) == (("update", 3), True)
    assert queue_rule(FragmentUpdate(1, 3, 7, values, 0.0, 1, reason="join")) == (("update", 3), False)
    assert queue_rule(FragmentUpdate(1, 3, 7, values, 0.0, 1, reason="stale")) == (("update", 3), False)
    if "kind" in FragmentUpdate.__dataclass_fields__:  # compressed down-links
        delta = FragmentUpdate(1, 3, 7, values, 0.0, 1, kind="delta", base_version=6)  # type: ignore[call-arg]
        assert queue_rule(delta) == (None, True)  # a delta chains on the one before: never replaced
    assert queue_rule(FragmentRequest(1, 3, 9)) == (("request", 3), False)
    assert queue_rule(SyncerHeartbeat(5, 0)) == (("heartbeat",), False)
    assert queue_rule(JoinReply(True, "", 5, 0, [0])) == (None, False)


def test_a_router_whose_peer_stops_reading_keeps_the_backlog_in_our_queue() -> None:
    """A DEALER that reads nothing: ZeroMQ takes a few messages (and the kernel's buffers some
    more), the rest wait in the queue, where the newest version of each fragment replaces the
    older and the bound drops the oldest; once the peer reads, what waited arrives in order."""
    import zmq

    from ddiloco.service.base.transport import ZmqSyncerSocket

    router = ZmqSyncerSocket("tcp://127.0.0.1:*", queue_bytes=8 << 20)
    address = bytes(router.sock.getsockopt(zmq.LAST_ENDPOINT)).decode()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 2)
    dealer.connect(address)
    try:
        dealer.send(b"hello")
        got = router.recv(5.0, 1)
        assert got, "no hello"
        identity = got[0].identity
        payload = 1 << 20
        for v in range(60):  # 60 MiB for 4 fragments: far more than the kernel buffers and the bound
            router.send(identity, [b"%d.%d" % (v % 4, v), bytes(payload)], key=("update", v % 4), droppable=True)
        q = router.queues[identity]
        assert q.nbytes <= 8 << 20
        assert router.counts["send_replaced"] > 0
        received: list[tuple[int, int]] = []
        while router.pump() or dealer.poll(200):
            while dealer.poll(0):
                header = dealer.recv_multipart()[0].decode()
                received.append(tuple(int(x) for x in header.split(".")))  # type: ignore[arg-type]
        for p in range(4):  # each fragment's versions arrive in order
            versions = [v for q, v in received if q == p]
            assert versions == sorted(versions)
        last = {p: v for p, v in received}  # the newest version of each fragment arrives
        assert last == {0: 56, 1: 57, 2: 58, 3: 59}
        assert len(received) < 60  # older versions were replaced, unsent
    finally:
        dealer.close(0)
        router.close()
