"""The optimizer hand-off on a serving learner's link: the comm thread's queue for it.

A learner serving its optimizer state hands the comm thread the pieces each step boundary copied
(``LearnerSession.complete``, as many as the session's budget allowed: ``protocol/handoff.py``).
They wait here, behind every other message, and go to the transport a few at a time: at most
about ``IN_FLIGHT_S`` of the link's time (and ``MAX_IN_FLIGHT`` messages) sit in ZeroMQ's own
queue, so an answer or a heartbeat sent meanwhile waits behind little and never finds that
queue (64 messages) full, while training goes on. The transport says when it is done with a
message (``TrackingSocket.send_tracked``: its bytes written to the connection); from that the
queue measures its link's rate (hand-off bytes done per second while it had some to send) and
the comm thread tells the session what is done (``LearnerSession.sending``), so the next
boundary copies what the link can take, and nothing while this queue still holds enough.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ddiloco.protocol.handoff import handoff_nbytes, is_piece
from ddiloco.protocol.learner_session import Send
from ddiloco.protocol.messages import PeerState
from ddiloco.service.base.transport import DONE, Tracked
from ddiloco.service.base.wire import encode

log = logging.getLogger(__name__)

IN_FLIGHT_S = 0.05
"""Link time the hand-off may have queued in the transport at once (by the measured rate)."""
MAX_IN_FLIGHT = 16
"""Hand-off messages in the transport at once, at most (ZeroMQ's queue holds 64 in all)."""
UNMEASURED_IN_FLIGHT = 8 << 20
"""Bytes in the transport at once before the rate is measured."""
RATE_WINDOW_S = 0.25
"""Busy seconds one rate measurement spans (a shorter one ends when the queue empties)."""
POLL_S = 0.002
"""How soon the comm thread looks again while hand-off messages are in the transport."""
RETRY_S = 0.05
"""How soon it tries again when the transport took nothing (not connected, queue full)."""
SMOOTHING = 0.5
"""Weight of the newest measurement in the rate."""


@dataclass
class _Serving:
    """One hand-off under way, as this queue saw it."""

    started: float
    nbytes: int = 0


class HandoffSender:
    """The hand-off messages of one learner, waiting for its link (the comm thread's only)."""

    def __init__(self, send: Callable[[int, list[object]], Tracked | None], clock: Callable[[], float]) -> None:
        """``send``: the transport's ``send_tracked``; ``clock``: monotonic seconds."""
        self._send, self.clock = send, clock
        self.waiting: deque[tuple[Send, int]] = deque()
        self.in_flight: deque[tuple[Tracked, int, PeerState]] = deque()
        self.in_flight_bytes = 0
        self.done = 0
        """Bytes of the hand-off messages that the transport is done with, or that were dropped."""
        self.rate = 0.0
        """Bytes per second the transport took them at, lately (0: not measured yet)."""
        self.served: list[tuple[int, int, float, float]] = []
        """Hand-offs whose last message went: (learner, bytes, when its first piece came here, when
        the transport was done with its last), on ``clock``."""
        self._serving: dict[int, _Serving] = {}
        self._window = (0, 0.0)  # (bytes, busy seconds) of the measurement under way
        self._last: float | None = None
        self._was_busy = False
        self._stuck = False

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.in_flight)

    @property
    def poll_s(self) -> float:
        """How soon ``pump`` has something to do (only while ``busy``)."""
        return RETRY_S if self._stuck and not self.in_flight else POLL_S

    def put(self, send: Send) -> None:
        msg = send.msg
        assert isinstance(msg, PeerState)
        self.waiting.append((send, handoff_nbytes(msg)))
        self._serving.setdefault(msg.learner, _Serving(self.clock()))

    def pump(self) -> None:
        """Collect what the transport is done with, measure, and hand it more."""
        now = self.clock()
        busy_s = now - self._last if self._last is not None and self._was_busy else 0.0  # busy since the last pump
        got = 0
        while self.in_flight and self.in_flight[0][0].done:
            _, n, msg = self.in_flight.popleft()
            self.in_flight_bytes -= n
            got += n
            self._finished(msg, n, now)
        self.done += got
        self._push()
        self._measure(got, busy_s)
        self._last, self._was_busy = now, self.busy

    def _push(self) -> None:
        limit = self.rate * IN_FLIGHT_S if self.rate > 0 else UNMEASURED_IN_FLIGHT
        self._stuck = False
        while self.waiting and len(self.in_flight) < MAX_IN_FLIGHT:
            send, n = self.waiting[0]
            if len(self.in_flight) >= 2 and self.in_flight_bytes + n > limit:
                return
            tracked = self._send(send.shard, encode(send.msg))
            if tracked is None:
                self._stuck = True
                return
            self.waiting.popleft()
            self.in_flight.append((tracked, n, send.msg))
            self.in_flight_bytes += n

    def _measure(self, got: int, busy_s: float) -> None:
        nbytes, seconds = self._window
        nbytes, seconds = nbytes + got, seconds + busy_s
        if nbytes > 0 and seconds > 0 and (seconds >= RATE_WINDOW_S or not self.busy):
            sample = nbytes / seconds
            self.rate = sample if self.rate <= 0 else (1 - SMOOTHING) * self.rate + SMOOTHING * sample
            nbytes, seconds = 0, 0.0
        self._window = (nbytes, seconds)

    def _finished(self, msg: PeerState, n: int, now: float) -> None:
        serving = self._serving.get(msg.learner)
        if serving is None:
            return
        serving.nbytes += n
        if not is_piece(msg):
            del self._serving[msg.learner]
            seconds = now - serving.started
            self.served.append((msg.learner, serving.nbytes, serving.started, now))
            log.info(
                "learner %d: sent its optimizer state to learner %d: %.1f MB in %.1f s (%.1f MB/s on its link lately)",
                msg.source, msg.learner, serving.nbytes / 1e6, seconds, self.rate / 1e6,
            )  # fmt: skip

    def drop(self) -> None:
        """The link went: what waits was for a connection that is gone (counted done: dropped)."""
        self.done += sum(n for _, n in self.waiting) + self.in_flight_bytes
        self.waiting.clear()
        self.in_flight.clear()
        self.in_flight_bytes = 0
        self._serving.clear()
        self._window, self._last, self._was_busy = (0, 0.0), None, False


def untracked(send: Callable[[int, list[object]], bool]) -> Callable[[int, list[object]], Tracked | None]:
    """A transport's plain ``send`` as ``send_tracked``: done at once when it was taken."""
    return lambda link, frames: DONE if send(link, frames) else None
