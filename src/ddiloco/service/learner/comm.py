"""A learner's comm thread: it pumps the learner's ``LearnerSession`` with the network.

The session (``ddiloco.protocol.learner_session``) holds every rule; this thread owns the
transport. It decodes what arrives and hands it to the session, runs the session's ticks at
its deadlines (heartbeats, liveness, registration with backoff), and encodes and sends whatever
the session returns, including what the training thread's step boundaries produced (posted to
``outbox``). The training thread and this thread share the session under one short lock: every
session call is pure bookkeeping (no I/O, no tensor copies), so neither waits on the other for
long, and the training thread never waits on the network. The pieces of an optimizer state this
learner serves wait behind everything else, in ``handoff`` (``handoff_sender.py``), which paces
them by the link and measures it; the session hears what went (``LearnerSession.sending``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterable

from ddiloco.core.messages import Contribution
from ddiloco.protocol.learner_session import LearnerOutput, LearnerSession, Send
from ddiloco.protocol.messages import PeerState
from ddiloco.service.base.clock import Clock
from ddiloco.service.base.transport import LearnerSocket
from ddiloco.service.base.wire import SchemaMismatch, WireError, decode, encode, largest_piece
from ddiloco.service.base.wire_schemas import OLDEST_SERVED, SCHEMA
from ddiloco.service.learner.handoff_sender import HandoffSender, untracked

log = logging.getLogger(__name__)


class LearnerComm:
    """The comm thread of one learner, and what it shares with the training thread."""

    def __init__(self, session: LearnerSession, addresses: list[str], sock: LearnerSocket, clock: Clock) -> None:
        self.session = session
        self.addresses = addresses
        self.sock, self.clock = sock, clock
        self.lock = threading.Lock()
        """Guards ``session``: held only for session calls, never across I/O."""
        self.outbox: queue.Queue[Send] = queue.Queue()
        self._reconnects: queue.Queue[int] = queue.Queue()
        self.reconnects = 0
        """Links dropped and opened again on a fresh connection (the session asked)."""
        self.stop = threading.Event()
        self.arrived = threading.Event()
        """Set when a message was taken in: a training thread waiting for one wakes up."""
        self.died: str | None = None
        self.cpu_s = 0.0
        self.wire_bytes_sent = 0
        """Bytes of contributions on the wire (every frame, to every shard); this thread only."""
        self._warned: set[str] = set()
        self._max_numel = largest_piece(session.layout)
        """The most values an encoded piece from a syncer may decode to (a forged sparse piece asks
        for up to ~9,000x its frame's bytes)."""
        tracked = getattr(sock, "send_tracked", None)
        self.handoff = HandoffSender(tracked if tracked is not None else untracked(sock.send), clock.monotonic)
        """The optimizer state this learner serves, waiting for its link (this thread's only)."""
        self._thread = threading.Thread(target=self._run, name=f"ddiloco-comm-{session.learner}", daemon=True)

    # -- the training thread's side ----------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def post(self, out: LearnerOutput) -> None:
        """Queue what a session call returned and wake the comm thread (once for all of it)."""
        self.say(out.notes)
        self.tell(out.info)
        if not out.send and not out.reconnect:
            return
        for link in out.reconnect:  # the socket is the comm thread's: it reconnects
            self._reconnects.put(link)
        for send in out.send:
            self.outbox.put(send)
        self.sock.wake()

    def close(self, timeout_s: float = 2.0) -> None:
        """Leave cleanly (when not killed) and stop the thread."""
        self.stop.set()
        self.sock.wake()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def tell(self, lines: Iterable[str]) -> None:
        """Log what happened (a rejoin, the run's end) at INFO."""
        for line in lines:
            log.info("%s", line)

    def say(self, notes: Iterable[str]) -> None:
        """Log what the session noted (each distinct line once at WARNING, then at DEBUG)."""
        for note in notes:
            key = note.split(":")[0] + note[-40:]
            level = logging.DEBUG if key in self._warned else logging.WARNING
            self._warned.add(key)
            log.log(level, "%s", note)

    # -- the comm thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a dead comm thread must end the learner, not leave it training alone
            self.died = f"{type(e).__name__}: {e}"
            log.exception("learner %d: comm thread died", self.session.learner)
            self.stop.set()
            with contextlib.suppress(Exception):  # already dying: the socket must not outlive the thread
                self.sock.close(linger_s=0.0)
        finally:
            self.cpu_s = time.thread_time()

    def _loop(self) -> None:
        session = self.session
        while not self.stop.is_set():
            now = self.clock.monotonic()
            with self.lock:
                session.sending(self.handoff.done, self.handoff.rate)
                out = session.tick(now)
                deadline = session.next_deadline(now)
            self._send(out)
            wait = 0.25 if deadline is None else min(max(0.0, deadline - now), 0.25)
            if self.handoff.busy:
                wait = min(wait, self.handoff.poll_s)
            for index, frames in self.sock.recv(wait):
                try:
                    msg = decode(frames, self._max_numel)
                except SchemaMismatch as e:  # a syncer of a version this one cannot talk to
                    with self.lock:
                        session.refuse(
                            f"syncer {self.addresses[index]} speaks wire schema {e.theirs}, this learner speaks "
                            f"{SCHEMA} and serves {OLDEST_SERVED} to {SCHEMA}: run the syncer's ddiloco version here"
                        )
                    continue
                except WireError as e:
                    where = self.addresses[index]
                    self.say([f"learner {session.learner}: dropped a malformed message from {where}: {e}"])
                    with self.lock:  # still proof the link is alive (only its shard sends on it)
                        session.heard(index, self.clock.monotonic())
                    continue
                with self.lock:
                    out = session.receive(index, msg, self.clock.monotonic())
                self.arrived.set()
                self._send(out)
            self._drain()
            if session.done:
                break  # refused, or the final model is written: nothing more to say
            self.cpu_s = time.thread_time()
        self._drain()
        with self.lock:
            out = session.leave()
        self._send(out)
        self.sock.close(linger_s=0.2)
        self.stop.set()
        self.arrived.set()

    def _drain(self) -> None:
        while not self._reconnects.empty():
            self._reconnect(self._reconnects.get_nowait())
        while True:
            try:
                send = self.outbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(send.msg, PeerState):  # a piece of the state it serves: behind the rest, paced
                self.handoff.put(send)
            else:
                self._send_one(send)
        if self.handoff.busy:
            done = self.handoff.done
            self.handoff.pump()
            if self.handoff.done != done:  # the next boundary must see it (this loop may sleep a while next)
                with self.lock:
                    self.session.sending(self.handoff.done, self.handoff.rate)

    def _reconnect(self, link: int) -> None:
        log.info("learner %d: reconnecting to %s on a fresh connection", self.session.learner, self.addresses[link])
        self.reconnects += 1
        if link == 0:  # the hand-off goes through shard 0: what waits was for the old connection
            self.handoff.drop()
        self.sock.reconnect(link)

    def _send(self, out: LearnerOutput) -> None:
        self.say(out.notes)
        self.tell(out.info)
        for link in out.reconnect:
            self._reconnect(link)
        for send in out.send:
            self._send_one(send)

    def _send_one(self, send: Send) -> None:
        frames = encode(send.msg)
        if isinstance(send.msg, Contribution):
            self.wire_bytes_sent += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
        self.sock.send(send.shard, frames)
