"""How the service's processes reach each other: ZeroMQ, or an in-process network for tests.

The syncer service and the learner's comm thread only see the two small interfaces below, so a
test can run a syncer and several learners as threads in one process, over a network that
drops, duplicates, delays and reorders messages on a seeded schedule, the way torchft tests
its manager. Messages are multipart frames (``wire.encode``) either way.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from ddiloco.service.base.keys import ClientKeys, ServerKeys
from ddiloco.service.base.pending import FIRST_COMMAND, GREETING, PendingGate

log = logging.getLogger(__name__)
Frames = list[Any]
"""A multipart message: bytes-like frames (``zmq.Frame`` objects from ZeroMQ)."""
HandshakeFailure = Literal["mechanism", "auth", "curve"]
"""Why a learner's connection to a syncer failed its handshake, as ZeroMQ tells the client:
"mechanism": one side uses CURVE keys and the other none (ZMTP mechanism mismatch); "auth": the
syncer does not admit this client's key (ZAP status 400); "curve": the CURVE handshake keeps
failing without detail (the client's copy of the syncer's public key is not the syncer's)."""
ROUTER_HWM = 4
"""Messages ZeroMQ itself holds per peer at the syncer (its ``SNDHWM``): few, so that what waits
for a slow link waits in our ``SendQueue``, bounded in bytes, where a newer version can replace
it, and not in ZeroMQ's pipe, bounded only in messages (1,000 fragments of a GPT were 146 MB)."""
GATE_EVERY_S = 0.25
"""How often the syncer looks at the connections that have not started a handshake (each look
reads the kernel's TCP_INFO of each: a few microseconds apiece)."""
NO_DETAIL_RUN = 5
"""Handshakes in a row that a keyed client sees fail without detail before it calls its copy of
the syncer's key wrong: a mechanism mismatch may also end a few attempts early (the server hangs
up before the client has read its greeting) before ZeroMQ reports it as one."""


def learner_identity(learner: int) -> bytes:
    """A learner's name on the in-process network (``InProcessNetwork.cut`` kills it by this
    name). It is never a route: the syncer's ROUTER names each connection itself, so no peer
    can choose a route and take over another's (a restarted process registers again)."""
    return b"learner-%d" % learner


class Received(NamedTuple):
    """One message at the syncer."""

    identity: bytes
    """The sender's connection, as the syncer's end named it (replies go to it): never chosen
    by the peer, and a new connection gets a new one."""
    frames: Frames
    """The message."""
    key: bytes | None
    """The sender's authenticated public key (Z85), or None without CURVE."""


class SyncerSocket(Protocol):
    """The syncer's end: one address, many learners and observers, each with an identity."""

    def recv(self, timeout_s: float, limit: int) -> list[Received]:
        """Up to ``limit`` messages, waiting at most ``timeout_s``."""
        ...

    def send(self, identity: bytes, frames: Frames, key: Hashable | None = None, droppable: bool = False) -> bool:
        """Queue a message for ``identity`` without blocking; False when it was dropped. ``key``:
        a queued, unsent message of ``identity`` with the same key is replaced by this one (a
        newer version of the same thing); ``droppable``: it may be dropped when the peer's queue
        is over its bytes (see ``SendQueue``)."""
        ...

    def pump(self) -> bool:
        """Move queued messages on to the network until it would block; True while some wait."""
        ...

    def close(self) -> None: ...


class LearnerSocket(Protocol):
    """A learner's end: one link per syncer shard, in shard order."""

    def send(self, link: int, frames: Frames) -> bool:
        """Queue a message to shard ``link`` without blocking; False when it cannot be queued."""
        ...

    def recv(self, timeout_s: float) -> list[tuple[int, Frames]]:
        """Messages as (link, frames), waiting at most ``timeout_s`` or until ``wake``."""
        ...

    def reconnect(self, link: int) -> None:
        """Drop link ``link``'s connection and open a fresh one (the syncer sees a new peer:
        what it still had queued for the old one is lost, and the learner registers again)."""
        ...

    def wake(self) -> None:
        """Make a waiting ``recv`` return now (thread-safe)."""
        ...

    def handshake_failure(self) -> tuple[int, HandshakeFailure] | None:
        """A link whose last connection attempt failed its handshake, and why (None: none did);
        seen by ``recv``. A failure that repeats on every reconnection is a key problem."""
        ...

    def close(self, linger_s: float = 0.0) -> None: ...


class Tracked(Protocol):
    """A message handed to a transport: ``done`` once the transport let go of it (its bytes
    written to the connection, or the connection gone)."""

    @property
    def done(self) -> bool: ...


class TrackingSocket(Protocol):
    """A learner's transport that says when it is done with a message (``ZmqLearnerSocket``,
    the in-process network's): the comm thread paces the optimizer hand-off by it and measures
    its link's rate. A transport without ``send_tracked`` is taken as done at once."""

    def send_tracked(self, link: int, frames: Frames) -> Tracked | None:
        """Queue a message to shard ``link`` without blocking (None: it cannot be queued now:
        not connected, or the queue is full; try again later)."""
        ...


class _Done:
    """A message the transport is done with at once."""

    done = True


DONE: Tracked = _Done()


# -- the syncer's send queue -----------------------------------------------------------------


def frames_bytes(frames: Frames) -> int:
    """The bytes of a multipart message (its frames' buffers)."""
    return sum(memoryview(f.buffer if hasattr(f, "buffer") else f).nbytes for f in frames)


@dataclass
class _Queued:
    frames: Frames
    nbytes: int
    droppable: bool


class SendQueue:
    """One peer's messages waiting for its link, oldest first, bounded in bytes.

    A message put with a ``key`` replaces a waiting one with the same key, in its place: a newer
    version of fragment p goes out where the older one would have (what the learner needs, no
    later than before), and the replaced one is never sent. The pair keeps the stricter of the
    two ``droppable`` flags (a join's fragment stays undroppable when a merged version replaces it).

    When the waiting bytes exceed ``max_bytes``, the oldest droppable messages are dropped (the
    new one included) until they fit. Messages that are not droppable are kept over the bound:
    the service keys the kinds that repeat (one request per fragment, one heartbeat), so they
    stay few, and a join's fragments are one model at most. Not thread-safe: one syncer thread
    owns it."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        """Bytes waiting."""
        self.dropped = 0
        """Messages dropped to fit the bound."""
        self.dropped_bytes = 0
        """Their bytes."""
        self.replaced = 0
        """Messages replaced, unsent, by a newer one with their key."""
        self._items: OrderedDict[Hashable, _Queued] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, frames: Frames, key: Hashable | None = None, droppable: bool = False) -> bool:
        """Queue ``frames``; False when it was dropped at once (it did not fit)."""
        item = _Queued(frames, frames_bytes(frames), droppable)
        old = self._items.get(key) if key is not None else None
        if old is not None:
            item.droppable = old.droppable and droppable
            self._items[key] = item  # an OrderedDict keeps the key's place
            self.nbytes += item.nbytes - old.nbytes
            self.replaced += 1
        else:
            key = key if key is not None else object()  # unkeyed: a key nothing else has
            self._items[key] = item
            self.nbytes += item.nbytes
        self._fit()
        return self._items.get(key) is item

    def first(self) -> Frames | None:
        """The oldest waiting message (None: none)."""
        return next(iter(self._items.values())).frames if self._items else None

    def pop_first(self) -> None:
        """It was handed to the network."""
        _, item = self._items.popitem(last=False)
        self.nbytes -= item.nbytes

    def _fit(self) -> None:
        while self.nbytes > self.max_bytes:
            key = next((k for k, it in self._items.items() if it.droppable), None)
            if key is None:
                return  # only undroppable messages wait: kept (see the class docstring)
            item = self._items.pop(key)
            self.nbytes -= item.nbytes
            self.dropped += 1
            self.dropped_bytes += item.nbytes


# -- ZeroMQ -----------------------------------------------------------------------------------


class ZmqSyncerSocket:
    """A ROUTER socket bound to ``address``."""

    def __init__(
        self,
        address: str,
        max_frame_bytes: int = -1,
        keys: ServerKeys | None = None,
        queue_bytes: int = 512 << 20,
        max_pending: int = 256,
        pending_s: float = 10.0,
    ) -> None:
        """``max_frame_bytes`` > 0: a peer that sends a larger frame is disconnected by ZeroMQ
        before the frame is buffered (see ``wire.max_frame_bytes``). With ``keys``, CURVE
        authenticates and encrypts every connection and admits only the allowed keys.
        ``queue_bytes``: each peer's ``SendQueue`` bound (``runtime.send_queue_mb``).
        ``max_pending``, ``pending_s``: TCP connections that have not started their handshake,
        at most this many and this long (``pending.PendingGate``; 0: no bound but ZeroMQ's)."""
        self.auth = None
        self.keys = keys
        self.queue_bytes = queue_bytes
        self.queues: dict[bytes, SendQueue] = {}
        """Per peer (connection), what waits for its link; a queue that empties is removed."""
        self.counts = {"send_dropped": 0, "send_dropped_bytes": 0, "send_replaced": 0, "send_unroutable": 0,
                       "connections_cut": 0, "connections_pending": 0}  # fmt: skip
        """Messages dropped to fit a queue's bound (and their bytes), replaced unsent by a newer
        version, and dropped because their peer's connection is gone; connections cut before
        their handshake started, and those waiting now (``pending.PendingGate``)."""
        self._warned = False
        ctx = zmq.Context.instance()
        if keys is not None:
            # One ZAP handler per context: a context of its own, so several servers may coexist.
            ctx = zmq.Context()
            self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("ddiloco.service.auth"))
            self.auth.start()
            self.auth.configure_curve_callback("*", _Allowed(set(keys.allowed)))
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            self.sock.curve_secretkey = keys.secret
            self.sock.curve_publickey = keys.public
            self.sock.curve_server = True
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        # No ROUTER_HANDOVER, and peers' routing ids are ignored: the ROUTER names every
        # connection itself, so a peer (whatever its key) cannot take over another's route.
        # The session binds learner m to the connection whose key is m's and that registered.
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        # Few messages in ZeroMQ's pipe per peer: the rest waits in our byte-bounded queue. With
        # ROUTER_MANDATORY a full pipe says EAGAIN (kept, sent later) instead of dropping silently,
        # and a peer whose connection is gone says EHOSTUNREACH (its queue is dropped).
        self.sock.setsockopt(zmq.SNDHWM, ROUTER_HWM)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.gate: PendingGate | None = None
        self._guard_thread: threading.Thread | None = None
        self._guard_stop = threading.Event()
        self._watch: zmq.Socket[Any] | None = None
        if address.startswith("tcp://") and max_pending > 0:
            first = GREETING + FIRST_COMMAND["curve" if keys is not None else "null"]
            self.gate = PendingGate(max_pending, pending_s, first)  # (its port once bound, below)
            watch = self.sock.get_monitor_socket(
                zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED,
                addr=f"inproc://ddiloco-monitor-{next(_MONITORS)}",
            )
            watch.setsockopt(zmq.RCVHWM, 0)
            # A thread of its own: ZeroMQ accepts while the service's loop merges or writes, and
            # its monitor drops the events it cannot deliver (1,000 queued), so the gate must not
            # be paced by that loop. The thread owns the monitor socket from here on.
            self._watch = watch  # closed here if the thread never starts
            self._guard_thread = threading.Thread(
                target=self._guard, args=(watch,), name="ddiloco-pending", daemon=True
            )
        try:
            self.sock.bind(address)
        except zmq.ZMQError:
            self.close()
            raise
        if self._guard_thread is not None and self.gate is not None:
            endpoint = bytes(self.sock.getsockopt(zmq.LAST_ENDPOINT)).decode()
            self.gate.port = int(endpoint.rsplit(":", 1)[1])
            self._guard_thread.start()

    def _guard(self, watch: zmq.Socket[Any]) -> None:
        """Read ZeroMQ's connection events as they come; every ``GATE_EVERY_S`` (at once when
        twice the bound wait) cut the connections that wait too long or too many without
        starting a handshake."""
        assert self.gate is not None
        gated_at = 0.0
        try:
            while not self._guard_stop.is_set():
                ready = watch.poll(int(GATE_EVERY_S * 1000))
                now = time.monotonic()
                while ready and watch.poll(0):
                    ev = recv_monitor_message(watch)
                    if ev["event"] == zmq.EVENT_ACCEPTED:
                        self.gate.accepted(int(ev["value"]), now)
                    elif ev["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                        self.gate.closed(int(ev["value"]))
                if now - gated_at >= GATE_EVERY_S or self.gate.pending() > 2 * self.gate.max_pending:
                    gated_at = now
                    self.gate.check(now)
                    self.counts["connections_cut"] = self.gate.cut_count
                    self.counts["connections_pending"] = self.gate.pending()
        except zmq.ZMQError as e:  # the socket closed under it: the server is closing
            log.debug("the pending-connection guard stops: %s", e)
        finally:
            watch.close(linger=0)

    def recv(self, timeout_s: float, limit: int) -> list[Received]:
        out: list[Received] = []
        if not self.sock.poll(int(timeout_s * 1000)):
            return out
        while len(out) < limit:
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            key = str(frames[-1].get("User-Id")).encode() if self.keys is not None else None
            out.append(Received(frames[0].bytes, frames[1:], key))
        return out

    def send(self, identity: bytes, frames: Frames, key: Hashable | None = None, droppable: bool = False) -> bool:
        q = self.queues.get(identity)
        if q is None:
            q = self.queues[identity] = SendQueue(self.queue_bytes)
        before = (q.dropped, q.dropped_bytes, q.replaced)
        kept = q.put(frames, key, droppable)
        self._count(q, before, identity)
        self._pump_one(identity, q)  # at once when the link keeps up: no added latency
        return kept

    def _count(self, q: SendQueue, before: tuple[int, int, int], identity: bytes) -> None:
        dropped = q.dropped - before[0]
        self.counts["send_dropped"] += dropped
        self.counts["send_dropped_bytes"] += q.dropped_bytes - before[1]
        self.counts["send_replaced"] += q.replaced - before[2]
        if dropped and not self._warned:
            self._warned = True
            log.warning(
                "the link to %r is slower than what the syncer sends it: %d B waiting, over runtime.send_queue_mb; "
                "dropping its oldest merged versions (it re-syncs; further drops are counted in the status)",
                identity, q.nbytes,
            )  # fmt: skip

    def _pump_one(self, identity: bytes, q: SendQueue) -> None:
        while True:
            frames = q.first()
            if frames is None:
                del self.queues[identity]
                return
            try:
                self.sock.send_multipart([identity, *frames], copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                return  # its pipe is full: the rest waits here (replaceable) for the next pump
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                # The connection is gone (the peer reconnects as a new one): nothing here reaches it.
                self.counts["send_unroutable"] += len(q)
                del self.queues[identity]
                return
            q.pop_first()

    def pump(self) -> bool:
        for identity, q in list(self.queues.items()):
            self._pump_one(identity, q)
        return bool(self.queues)

    def queued_bytes(self) -> int:
        """Bytes waiting in every peer's queue."""
        return sum(q.nbytes for q in self.queues.values())

    def close(self) -> None:
        self.queues.clear()
        if self._guard_thread is not None:
            self._guard_stop.set()
            if self._guard_thread.is_alive():
                self._guard_thread.join(timeout=5)
            elif self._watch is not None and self._guard_thread.ident is None:
                # never started (the bind failed): its monitor socket is ours to close, or the
                # keyed context's term() waits for it for ever
                self._watch.close(linger=0)
            self.sock.disable_monitor()
        self.sock.close(0)
        if self.auth is not None:
            self.auth.stop()
            self.sock.context.term()


class _Allowed:
    """The ZAP callback: a connection is admitted only with an allow-listed public key."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


_MONITORS = itertools.count()


class ZmqLearnerSocket:
    """One DEALER per syncer shard, plus an inproc pair the training thread uses to wake the
    comm thread, so it sleeps in poll instead of spinning on a short timeout."""

    def __init__(
        self,
        addresses: list[str],
        identity: bytes,
        reconnect_s: float,
        reconnect_max_s: float,
        keys: ClientKeys | None = None,
    ) -> None:
        """``identity`` is only a name for logs: the syncer routes by connection, not by it."""
        ctx = zmq.Context.instance()
        self.addresses, self.keys, self.name = list(addresses), keys, identity
        self._reconnect = (reconnect_s, reconnect_max_s)
        self.monitors: list[zmq.Socket[Any]] = []
        """Per link, ZeroMQ's handshake events of its DEALER (so a key problem is told as one)."""
        self._handshake: dict[int, HandshakeFailure] = {}
        self._no_detail: dict[int, int] = {}
        self.socks: list[zmq.Socket[Any]] = []
        for addr in addresses:
            sock, mon = self._dealer(addr)
            self.socks.append(sock)
            self.monitors.append(mon)
        name = f"inproc://ddiloco-wake-{id(self)}"
        self._wake_rx = ctx.socket(zmq.PAIR)
        self._wake_rx.bind(name)
        self._wake_tx = ctx.socket(zmq.PAIR)
        self._wake_tx.connect(name)
        self._wake_lock = threading.Lock()
        self._closed = False
        self.poller = zmq.Poller()
        for s in [*self.socks, *self.monitors]:
            self.poller.register(s, zmq.POLLIN)
        self.poller.register(self._wake_rx, zmq.POLLIN)

    def _dealer(self, addr: str) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
        """A DEALER connecting to ``addr``, and its handshake monitor (watching before it connects:
        ZeroMQ does not retry after a mechanism mismatch, so that one event must not be missed)."""
        s: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        if self.keys is not None:
            self.keys.apply(s)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IMMEDIATE, 1)  # do not queue for a syncer that is not connected
        s.setsockopt(zmq.SNDHWM, 64)
        s.setsockopt(zmq.RECONNECT_IVL, int(self._reconnect[0] * 1000))
        s.setsockopt(zmq.RECONNECT_IVL_MAX, int(self._reconnect[1] * 1000))
        mon = self._monitor(s)
        s.connect(addr)
        return s, mon

    @staticmethod
    def _monitor(s: zmq.Socket[Any]) -> zmq.Socket[Any]:
        # A name of our own: pyzmq's default names the endpoint after the socket's file
        # descriptor, which a socket closed a moment ago may still hold.
        return s.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
            addr=f"inproc://ddiloco-monitor-{next(_MONITORS)}",
        )

    def _close_link(self, link: int, linger_ms: int) -> None:
        s, mon = self.socks[link], self.monitors[link]
        for sock in (s, mon):
            self.poller.unregister(sock)
        s.disable_monitor()
        mon.close(linger=0)
        s.close(linger=linger_ms)

    def reconnect(self, link: int) -> None:
        self._close_link(link, 0)
        self.socks[link], self.monitors[link] = self._dealer(self.addresses[link])
        self.poller.register(self.socks[link], zmq.POLLIN)
        self.poller.register(self.monitors[link], zmq.POLLIN)

    def handshake_failure(self) -> tuple[int, HandshakeFailure] | None:
        return next(iter(sorted(self._handshake.items())), None)

    def _on_monitor(self, link: int) -> None:
        """ZeroMQ's handshake events, measured on loopback: a keyless client at a CURVE syncer
        sees a few failures without detail (the syncer hangs up first), then a protocol error
        (mechanism mismatch), and ZeroMQ stops retrying; a keyed client at a keyless syncer the
        protocol error; a key the syncer's ZAP handler refuses, an auth failure (400); a wrong
        copy of the syncer's public key, failures without detail on every retry."""
        mon = self.monitors[link]
        while mon.poll(0):
            event = recv_monitor_message(mon)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshake.pop(link, None)
                self._no_detail.pop(link, None)
            elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                self._handshake[link] = "mechanism"
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._handshake[link] = "auth"
            elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and link not in self._handshake:
                # Without keys, any failed handshake means the syncer wants keys: a keyless one never hangs up.
                self._no_detail[link] = n = self._no_detail.get(link, 0) + 1
                if self.keys is None:
                    self._handshake[link] = "mechanism"
                elif n >= NO_DETAIL_RUN:
                    self._handshake[link] = "curve"

    def send(self, link: int, frames: Frames) -> bool:
        try:
            self.socks[link].send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False  # not connected or queue full: the protocol retries, training goes on

    def send_tracked(self, link: int, frames: Frames) -> Tracked | None:
        """``send``, and a tracker that is done once ZeroMQ wrote every large frame to the
        connection (frames under ``zmq.COPY_THRESHOLD`` are copied: done at once). ZeroMQ checks
        its high-water mark on a message's first frame only, so it is queued whole or not at all."""
        sock, trackers = self.socks[link], []
        for i, frame in enumerate(frames):
            more = zmq.SNDMORE if i < len(frames) - 1 else 0
            try:
                tracker = sock.send(frame, flags=zmq.NOBLOCK | more, copy=False, track=True)
            except zmq.ZMQError as e:
                if i > 0:
                    return DONE  # the connection went mid-message: ZeroMQ dropped it
                if isinstance(e, zmq.Again):
                    return None  # not connected or queue full: try again later
                raise
            if tracker is not None and not tracker.done:
                trackers.append(tracker)
        return zmq.MessageTracker(*trackers) if trackers else DONE

    def recv(self, timeout_s: float) -> list[tuple[int, Frames]]:
        out: list[tuple[int, Frames]] = []
        for sock, _ in self.poller.poll(int(timeout_s * 1000)):
            if sock is self._wake_rx:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
                continue
            if sock in self.monitors:
                self._on_monitor(self.monitors.index(sock))
                continue
            link = self.socks.index(sock)
            while True:
                try:
                    out.append((link, sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)))
                except zmq.Again:
                    break
        return out

    def wake(self) -> None:
        with self._wake_lock:  # the training thread wakes; close() may run on the comm thread
            if self._closed:
                return
            try:
                self._wake_tx.send(b"", flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # a wake-up is already pending

    def close(self, linger_s: float = 0.0) -> None:
        for link in range(len(self.socks)):
            self._close_link(link, int(linger_s * 1000))
        self._wake_rx.close(linger=0)
        with self._wake_lock:
            self._closed = True
            self._wake_tx.close(linger=0)


# -- in-process network with faults ----------------------------------------------------------


@dataclass
class FaultInjector:
    """Decides each message's fate from a seeded stream: dropped, delivered once or twice,
    now or after a delay (delays reorder messages)."""

    seed: int = 0
    drop: float = 0.0
    """Probability a message is lost."""
    duplicate: float = 0.0
    """Probability a delivered message arrives twice."""
    delay: float = 0.0
    """Probability a copy is held back by ``delay_s``."""
    delay_s: float = 0.0
    """How long a delayed copy is held (longer than a round, to test staleness)."""
    counts: dict[str, int] = field(default_factory=lambda: {"sent": 0, "dropped": 0, "duplicated": 0, "delayed": 0})

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()

    def fates(self) -> list[float]:
        """Delays of the copies to deliver (empty: dropped)."""
        with self._lock:
            self.counts["sent"] += 1
            if self._rng.random() < self.drop:
                self.counts["dropped"] += 1
                return []
            copies = 2 if self._rng.random() < self.duplicate else 1
            self.counts["duplicated"] += copies - 1
            delays = []
            for _ in range(copies):
                held = self._rng.random() < self.delay
                self.counts["delayed"] += held
                delays.append(self.delay_s if held else 0.0)
            return delays


class _Inbox:
    """Messages waiting for one endpoint, ordered by delivery time."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Any]] = []
        self.closed = False
        self.woken = False


class InProcessNetwork:
    """Syncers and learners as threads of one process, their messages passing through a
    ``FaultInjector``. Frames are copied to bytes on send, as a real network would."""

    def __init__(self, faults: FaultInjector | None = None) -> None:
        self.faults = faults or FaultInjector()
        self.cv = threading.Condition()
        self._seq = itertools.count()
        self._servers: dict[str, _Inbox] = {}
        self._clients: dict[bytes, list[_HubLearner]] = {}
        self._routes: dict[bytes, tuple[_HubLearner, int]] = {}
        """Route (what the syncer sees as the sender) -> the learner end and its link."""

    def _post(self, inbox: _Inbox, item: Any) -> None:
        now = time.monotonic()
        for delay in self.faults.fates():
            heapq.heappush(inbox.heap, (now + delay, next(self._seq), item))
        self.cv.notify_all()

    def _take(self, inbox: _Inbox, timeout_s: float, limit: int) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while True:
                now = time.monotonic()
                out: list[Any] = []
                while inbox.heap and inbox.heap[0][0] <= now and len(out) < limit:
                    out.append(heapq.heappop(inbox.heap)[2])
                woken, inbox.woken = inbox.woken, False
                if out or woken or inbox.closed or now >= deadline:
                    return out
                due = inbox.heap[0][0] if inbox.heap else deadline
                self.cv.wait(max(0.0, min(deadline, due) - now))

    def syncer(self, address: str) -> SyncerSocket:
        with self.cv:
            if address in self._servers and not self._servers[address].closed:
                raise zmq.ZMQError(zmq.EADDRINUSE)
            inbox = self._servers[address] = _Inbox()
        return _HubSyncer(self, address, inbox)

    def learner(self, addresses: list[str], identity: bytes, key: bytes | None = None) -> LearnerSocket:
        """A learner's end, named ``identity`` (``cut`` kills by name). Each of its links gets a
        route of the network's choosing, as a ROUTER names a connection: a second process with
        the same name connects beside the first, and takes nothing over."""
        with self.cv:
            client = _HubLearner(self, list(addresses), identity, _Inbox(), key)
            self._clients.setdefault(identity, []).append(client)
            for link in range(len(addresses)):
                self._new_route(client, link)
            self.cv.notify_all()
        return client

    def _new_route(self, client: _HubLearner, link: int) -> None:
        """Give ``client``'s link a fresh route (the old one, if any, leads nowhere now)."""
        if link < len(client.routes):
            self._routes.pop(client.routes[link], None)
        route = b"%s#%d" % (client.identity, next(self._seq))
        self._routes[route] = (client, link)
        if link < len(client.routes):
            client.routes[link] = route
        else:
            client.routes.append(route)

    def cut(self, identity: bytes) -> None:
        """The process behind ``identity`` died: nothing reaches it any more."""
        with self.cv:
            for client in self._clients.pop(identity, []):
                client.inbox.closed = True
                for route in client.routes:
                    self._routes.pop(route, None)
            self.cv.notify_all()


def _copy(frames: Frames) -> Frames:
    return [bytes(memoryview(f.buffer if hasattr(f, "buffer") else f)) for f in frames]


class _HubSyncer:
    def __init__(self, net: InProcessNetwork, address: str, inbox: _Inbox) -> None:
        self.net, self.address, self.inbox = net, address, inbox

    def recv(self, timeout_s: float, limit: int) -> list[Received]:
        return self.net._take(self.inbox, timeout_s, limit)

    def send(self, identity: bytes, frames: Frames, key: Hashable | None = None, droppable: bool = False) -> bool:
        # No bandwidth here: every message is taken at once, so nothing ever waits to be
        # replaced or dropped (the send queue is ZeroMQ's only).
        with self.net.cv:
            entry = self.net._routes.get(identity)
            if entry is None or entry[0].inbox.closed or entry[0].addresses[entry[1]] != self.address:
                return True  # like a ROUTER: a message to an unknown peer vanishes
            self.net._post(entry[0].inbox, (entry[1], _copy(frames)))
        return True

    def pump(self) -> bool:
        return False

    def close(self) -> None:
        with self.net.cv:
            self.inbox.closed = True
            self.net.cv.notify_all()


class _HubLearner:
    def __init__(
        self, net: InProcessNetwork, addresses: list[str], identity: bytes, inbox: _Inbox, key: bytes | None
    ) -> None:
        self.net, self.addresses, self.identity, self.inbox, self.key = net, addresses, identity, inbox, key
        self.routes: list[bytes] = []
        """Each link's current route (``InProcessNetwork._new_route``)."""

    def send_tracked(self, link: int, frames: Frames) -> Tracked | None:
        return DONE if self.send(link, frames) else None  # taken at once, or not at all

    def send(self, link: int, frames: Frames) -> bool:
        with self.net.cv:
            if self.inbox.closed:
                return False
            server = self.net._servers.get(self.addresses[link])
            if server is None or server.closed:
                return False  # not connected: like IMMEDIATE on a DEALER
            self.net._post(server, Received(self.routes[link], _copy(frames), self.key))
        return True

    def reconnect(self, link: int) -> None:
        with self.net.cv:
            if not self.inbox.closed:
                self.net._new_route(self, link)

    def recv(self, timeout_s: float) -> list[tuple[int, Frames]]:
        return self.net._take(self.inbox, timeout_s, 1 << 30)

    def wake(self) -> None:
        with self.net.cv:
            self.inbox.woken = True
            self.net.cv.notify_all()

    def handshake_failure(self) -> tuple[int, HandshakeFailure] | None:
        return None  # no handshake in-process (a key is taken as given)

    def close(self, linger_s: float = 0.0) -> None:
        with self.net.cv:
            self.inbox.closed = True
            for route in self.routes:
                self.net._routes.pop(route, None)
            self.net.cv.notify_all()
