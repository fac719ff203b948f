"""A learner's comm thread: everything the learner says to and hears from its syncer shards.

The training thread never waits on the network. This thread owns the transport: it registers
(and registers again, with backoff, when a syncer goes silent or restarts), heartbeats, answers
a fragment request at once from the contribution the training thread prepared at the last step
boundary (or tells the training thread to build it at the next one), and queues what arrives
(fragments, peer optimizer state) for the training thread to apply between inner steps. Nothing
here touches the model or the ``LearnerCore``: the training thread owns both.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ddiloco.config import RuntimeConfig
from ddiloco.core.messages import (
    LOSS_UNKNOWN,
    MAX_BUSY_S,
    MAX_COUNT,
    MAX_LOSS,
    MAX_STEP_TIME_S,
    Contribution,
    FragmentRequest,
    FragmentUpdate,
    Heartbeat,
    Leave,
)
from ddiloco.protocol.messages import JoinReply, PeerState, PeerStateRequest, Register, RunEnd, SyncerHeartbeat
from ddiloco.service.clock import Clock
from ddiloco.service.transport import LearnerSocket
from ddiloco.service.wire import WireError, decode, encode

log = logging.getLogger(__name__)


@dataclass
class ShardLink:
    """What the comm thread knows of one syncer shard."""

    address: str
    epoch: int | None = None
    last_heard: float | None = None
    joined: bool = False
    warned: bool = False
    next_join: float = 0.0
    backoff: float = 0.1
    owned: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Progress:
    """What the training thread tells the comm thread after each step (replaced whole)."""

    step: int = 0
    step_time_s: float = 0.0
    base_versions: tuple[int, ...] = ()
    tokens: int = 0
    """Tokens this incarnation processed."""
    busy_s: float = 0.0
    """Seconds this incarnation spent in inner steps."""
    loss: float | None = None
    """The last training loss the loop gave ``Learner.step`` (None: none yet)."""


def heartbeat(learner: int, incarnation: int, pr: Progress, bytes_sent: int) -> Heartbeat:
    """The heartbeat for ``pr``, every figure clamped into its wire bounds: a step longer than a
    day (a learner stopped in a debugger) is reported as a day, a loss that is negative, not
    finite or huge as unknown."""
    loss = pr.loss if pr.loss is not None and 0.0 <= pr.loss <= MAX_LOSS else LOSS_UNKNOWN  # NaN fails both
    return Heartbeat(
        learner,
        incarnation,
        pr.step,
        min(pr.step_time_s, MAX_STEP_TIME_S),
        min(pr.tokens, MAX_COUNT),
        min(max(pr.busy_s, 0.0), MAX_BUSY_S),
        loss,
        min(bytes_sent, MAX_COUNT),
    )


class LearnerComm:
    """The comm thread and the queues it shares with the training thread."""

    def __init__(
        self,
        rt: RuntimeConfig,
        learner: int,
        incarnation: int,
        params: list[list[Any]],
        layout_digest: str,
        addresses: list[str],
        sock: LearnerSocket,
        clock: Clock,
        device: str = "cpu",
    ) -> None:
        self.rt, self.learner, self.incarnation = rt, learner, incarnation
        self.params, self.layout_digest, self.device = params, layout_digest, device
        self.sock, self.clock = sock, clock
        self.links = [ShardLink(a, backoff=rt.backoff_initial_s) for a in addresses]
        # training thread -> comm thread
        self.outbox: queue.Queue[Any] = queue.Queue()
        self.progress = Progress()
        self._prepared: dict[int, Contribution] = {}
        self._lock = threading.Lock()
        # comm thread -> training thread
        self.inbox: queue.Queue[FragmentUpdate | PeerState] = queue.Queue()
        self.requests: queue.Queue[tuple[int, bool]] = queue.Queue()
        self.peer_requests: queue.Queue[int] = queue.Queue()
        self.first_join = threading.Event()
        self.data_position: int | None = None
        self.refused: str | None = None
        self.died: str | None = None
        self.run_end: str | None = None  # the syncer ended the run: "stop", then "done"
        self.end_reason = ""
        self.stop = threading.Event()
        self.cpu_s = 0.0
        self.answered = 0
        self.bytes_sent = 0
        """Bytes of contributions sent (every frame, to every shard it went to); written by this thread only."""
        self._thread = threading.Thread(target=self._run, name=f"ddiloco-comm-{learner}", daemon=True)

    # -- the training thread's side ----------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def post(self, *msgs: Any) -> None:
        """Queue messages to the syncer and wake the comm thread (once for all of them)."""
        if not msgs:
            return
        for msg in msgs:
            self.outbox.put(msg)
        self.sock.wake()

    def prepare(self, ready: dict[int, Contribution]) -> None:
        """The contributions to answer the next requests with, as of this step boundary."""
        with self._lock:
            self._prepared = ready

    def close(self, timeout_s: float = 2.0) -> None:
        """Leave cleanly (when not killed) and stop the thread."""
        self.stop.set()
        self.sock.wake()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the comm thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a dead comm thread must end the learner, not leave it training alone
            self.died = f"{type(e).__name__}: {e}"
            log.exception("learner %d: comm thread died", self.learner)
            self.stop.set()
        finally:
            self.cpu_s = time.thread_time()

    def _loop(self) -> None:
        rt = self.rt
        last_hb = -float("inf")
        started = self.clock.monotonic()
        while not self.stop.is_set():
            for index, frames in self.sock.recv(rt.heartbeat_interval_s / 2):
                link = self.links[index]
                try:
                    msg = decode(frames)
                except WireError as e:
                    log.warning("learner %d: dropped a malformed message from %s: %s", self.learner, link.address, e)
                    continue
                self._on_message(link, msg)
            now = self.clock.monotonic()
            while True:
                try:
                    out = self.outbox.get_nowait()
                except queue.Empty:
                    break
                for index in self._route(out):
                    self._send(index, out)
            if now - last_hb >= rt.heartbeat_interval_s:
                last_hb = now
                hb = encode(heartbeat(self.learner, self.incarnation, self.progress, self.bytes_sent))
                for index, link in enumerate(self.links):
                    if link.joined:
                        self.sock.send(index, hb)
            for index, link in enumerate(self.links):
                silent = now - (link.last_heard if link.last_heard is not None else started)
                if link.joined and silent > rt.syncer_liveness_s:
                    link.joined = False
                    link.next_join = now
                    if not link.warned:
                        link.warned = True
                        log.warning(
                            "learner %d: syncer %s unreachable for %.1f s; training on and retrying with backoff",
                            self.learner,
                            link.address,
                            silent,
                        )
                if not link.joined and now >= link.next_join:
                    self.sock.send(index, encode(self._register()))
                    link.next_join = now + link.backoff
                    link.backoff = min(link.backoff * 2, rt.backoff_max_s)
            self.cpu_s = time.thread_time()
        for index, link in enumerate(self.links):
            if link.joined:
                self.sock.send(index, encode(Leave(self.learner, self.incarnation)))
        self.sock.close(linger_s=0.2)

    def _send(self, index: int, msg: Any) -> None:
        """Encode and send one message; a contribution's bytes are counted."""
        frames = encode(msg)
        if isinstance(msg, Contribution):
            self.bytes_sent += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
        self.sock.send(index, frames)

    def _register(self) -> Register:
        bases = list(self.progress.base_versions) if self.first_join.is_set() else []
        return Register(
            self.learner, self.incarnation, self.params, self.layout_digest, bases, os.getpid(), self.device
        )

    def _route(self, msg: Any) -> list[int]:
        frag = getattr(msg, "fragment", None)
        if frag is None:
            return [0] if isinstance(msg, (PeerStateRequest, PeerState)) else list(range(len(self.links)))
        return [frag % len(self.links)]

    def _on_message(self, link: ShardLink, msg: Any) -> None:
        link.last_heard = self.clock.monotonic()
        if link.warned and link.joined:
            link.warned = False
        if isinstance(msg, SyncerHeartbeat):
            if link.epoch is not None and msg.epoch != link.epoch and link.joined:
                link.joined = False  # the syncer restarted: register again (keeping our progress)
                link.next_join = 0.0
            elif link.epoch is None and not link.joined:
                link.next_join = 0.0
        elif isinstance(msg, JoinReply):
            if not msg.accepted and msg.retry_after_s > 0:
                # e.g. our own predecessor (SIGKILLed a moment ago) still holds the id: try again
                log.info("learner %d: not registered yet (%s); retrying in %.1f s", self.learner, msg.reason,
                         msg.retry_after_s)  # fmt: skip
                link.next_join = self.clock.monotonic() + msg.retry_after_s
                return
            if not msg.accepted:
                self.refused = msg.reason
                self.stop.set()
                return
            link.epoch, link.joined, link.owned = msg.epoch, True, msg.owned
            link.backoff = self.rt.backoff_initial_s
            if self.data_position is None:
                self.data_position = msg.data_position
            self.first_join.set()
        elif isinstance(msg, RunEnd):
            if self.run_end != "done":
                self.run_end, self.end_reason = msg.stage, msg.reason
            if msg.stage == "done":
                self.stop.set()  # nothing more to say: the final model is written
        elif isinstance(msg, FragmentRequest):
            self._answer(link, msg.fragment)
        elif isinstance(msg, (FragmentUpdate, PeerState)):
            self.inbox.put(msg)
        elif isinstance(msg, PeerStateRequest):
            self.peer_requests.put(msg.learner)

    def _answer(self, link: ShardLink, p: int) -> None:
        """Answer at once from what the training thread prepared, or ask it to build the answer
        at its next step boundary: training is never paused for a request."""
        with self._lock:
            ready = self._prepared.get(p)
        if ready is not None:
            self._send(self.links.index(link), ready)
            self.answered += 1
        self.requests.put((p, ready is not None))
