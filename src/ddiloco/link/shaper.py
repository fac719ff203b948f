"""The relay's scheduler, pure: when may each chunk leave, given the link's rate, latency,
jitter and stalls, a shared site cap, and the faults' timeline.

Nothing here reads a clock or touches a socket: every call is handed ``now`` (seconds on the
relay's clock) and randomness comes from a seeded ``random.Random``, so the same inputs give
the same schedule, and tests run it in virtual time. ``relay.py`` pumps it with real bytes.

The model, per direction: a chunk offered at ``t`` waits for the link (a FIFO server at
``rate_bps``; one the site shares when there is a site cap), is serialized, then travels
``latency ± jitter`` (plus a stall, now and then), and leaves no earlier than the chunk ahead
of it: a byte stream stays in order, as TCP keeps it. A hold stops both serializing and
delivery until it ends. The queue is bounded: ``space()`` is what may be offered now.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Literal

from ddiloco.link.config import DirectionConfig, LinkFaults

EventKind = Literal["hold", "hold end", "cut", "cut end", "reset"]


class SiteRate:
    """An aggregate cap that several links draw from (a site's uplink shared by its learners):
    a FIFO server at ``rate_bps``. One per direction; give the same object to every link's
    shaper in that direction."""

    def __init__(self, rate_bps: float) -> None:
        if rate_bps <= 0:
            raise ValueError("a site rate must be > 0")
        self.rate_bps = rate_bps
        self._free_at = -math.inf

    def reserve(self, start: float, nbytes: int) -> float:
        """Serialize ``nbytes`` from ``start`` on (after what was reserved before); returns when done."""
        begin = max(start, self._free_at)
        self._free_at = begin + nbytes * 8 / self.rate_bps
        return self._free_at


@dataclass(frozen=True)
class LinkEvent:
    """A fault the relay acts on (resets) and logs."""

    time: float
    """When it happens, on the relay's clock."""
    kind: EventKind
    """A hold or cut starting or ending, or a reset of every connection."""
    duration_s: float = 0.0
    """How long a hold or cut lasts (at its start)."""


class FaultTimeline:
    """When a link is held, cut or reset. Resets at Poisson times are drawn from ``rng`` as
    time moves on, so the sequence is fixed by the seed whatever the polling."""

    def __init__(self, faults: LinkFaults, rng: random.Random) -> None:
        self.faults = faults
        self._rng = rng
        self._stopped_at = math.inf
        self._next_poisson = rng.expovariate(1.0 / faults.reset_mean_s) if faults.reset_mean_s else math.inf

    def stop(self, now: float) -> None:
        """No faults from ``now`` on: a hold or cut under way ends now (the run is ending and its
        final sync must get through)."""
        self._stopped_at = min(self._stopped_at, now)

    def _windows(self, t0: float, t1: float) -> list[tuple[str, float, float]]:
        """(kind, start, end) of every hold and cut that overlaps [t0, t1], clipped at the stop."""
        out = [(p.kind, p.start_s, p.end_s) for p in self.faults.partitions if p.start_s <= t1 and p.end_s >= t0]
        up, down = self.faults.flap_up_s, self.faults.flap_down_s
        if down > 0:
            period = up + down
            for k in range(max(0, math.floor((t0 - period) / period)), math.floor(t1 / period) + 1):
                start = k * period + up
                if start <= t1 and start + down >= t0:
                    out.append(("cut", start, start + down))
        return [(k, a, min(b, self._stopped_at)) for k, a, b in out if a < self._stopped_at]

    def _end_of(self, kind: str, t: float) -> float | None:
        """The latest end of a ``kind`` window that holds ``t`` (chained windows included)."""
        end = None
        probe = t
        while True:
            ends = [b for k, a, b in self._windows(probe, probe) if k == kind and a <= probe < b]
            if not ends:
                return end
            end = probe = max(ends)

    def hold_end(self, t: float) -> float | None:
        """When the hold under way at ``t`` ends (None: none is)."""
        return self._end_of("hold", t)

    def cut_end(self, t: float) -> float | None:
        """When the cut under way at ``t`` ends (None: none is)."""
        return self._end_of("cut", t)

    def unheld(self, t: float) -> float:
        """``t``, or the end of the hold under way then."""
        end = self.hold_end(t)
        return t if end is None else end

    def events(self, t0: float, t1: float) -> list[LinkEvent]:
        """What happens in (t0, t1], in time order: holds and cuts starting and ending, resets.
        Call it with consecutive intervals; each event comes once."""
        out: list[LinkEvent] = []
        for kind, a, b in self._windows(t0, t1):
            if t0 < a <= t1:
                out.append(LinkEvent(a, kind, b - a))  # type: ignore[arg-type]
            if t0 < b <= t1:
                out.append(LinkEvent(b, f"{kind} end"))  # type: ignore[arg-type]
        every = self.faults.reset_every_s
        if every:
            k = math.floor(t0 / every) + 1
            while k * every <= min(t1, self._stopped_at - 1e-12):
                out.append(LinkEvent(k * every, "reset"))
                k += 1
        while self._next_poisson <= t1:
            if self._next_poisson > t0 and self._next_poisson < self._stopped_at:
                out.append(LinkEvent(self._next_poisson, "reset"))
            self._next_poisson += self._rng.expovariate(1.0 / self.faults.reset_mean_s)
        order = {"hold end": 0, "cut end": 0, "hold": 1, "cut": 1, "reset": 2}
        return sorted(out, key=lambda e: (e.time, order[e.kind]))


NO_FAULTS = LinkFaults()


@dataclass
class _Chunk:
    data: bytes
    leaves_at: float


class DirectionShaper:
    """One direction of one connection: chunks in (``offer``), chunks out when due (``due``)."""

    def __init__(
        self,
        cfg: DirectionConfig,
        buffer_bytes: int,
        chunk_bytes: int,
        rng: random.Random,
        timeline: FaultTimeline | None = None,
        site: SiteRate | None = None,
    ) -> None:
        self.cfg = cfg
        self.buffer_bytes = buffer_bytes
        self.chunk_bytes = chunk_bytes
        self._rng = rng
        self._timeline = timeline or FaultTimeline(NO_FAULTS, rng)
        self._site = site
        self._queue: deque[_Chunk] = deque()
        self._queued = 0
        self._link_free = -math.inf
        self._last_leaves = -math.inf
        self.stalls = 0
        """Chunks held by a stall so far."""

    @property
    def queued_bytes(self) -> int:
        return self._queued

    def space(self) -> int:
        """Bytes that may be offered now (0: the sender must wait: backpressure)."""
        return max(0, self.buffer_bytes - self._queued)

    def offer(self, now: float, data: bytes) -> float:
        """Queue ``data`` (at most ``space()`` bytes) read at ``now``; returns when it may leave."""
        n = len(data)
        if n == 0 or n > self.space():
            raise ValueError(f"offered {n} bytes with {self.space()} free")
        # Serialization starts when the link is free and not held.
        start = self._timeline.unheld(max(now, self._link_free))
        done = start + (n * 8 / self.cfg.rate_bps if self.cfg.rate_bps else 0.0)
        if self._site is not None:
            done = max(done, self._site.reserve(start, n))
        self._link_free = done
        delay = self.cfg.latency_s
        if self.cfg.jitter_s:
            delay += self._rng.uniform(-self.cfg.jitter_s, self.cfg.jitter_s)
        if self.cfg.stall_prob and self.cfg.stall_s:
            # The chance is per chunk_bytes forwarded, so small reads do not stall more often.
            p = 1.0 - (1.0 - self.cfg.stall_prob) ** (n / self.chunk_bytes)
            if self._rng.random() < p:
                delay += self.cfg.stall_s
                self.stalls += 1
        leaves = max(done + max(delay, 0.0), self._last_leaves)  # in order, like the stream it is
        self._last_leaves = leaves
        self._queue.append(_Chunk(data, leaves))
        self._queued += n
        return leaves

    def due(self, now: float) -> list[bytes]:
        """The chunks that may leave at ``now``, in order (none while held)."""
        if self._timeline.hold_end(now) is not None:
            return []
        out = []
        while self._queue and self._queue[0].leaves_at <= now:
            c = self._queue.popleft()
            self._queued -= len(c.data)
            out.append(c.data)
        return out

    def next_due(self, now: float) -> float | None:
        """When the next chunk may leave (None: the queue is empty)."""
        if not self._queue:
            return None
        return max(self._queue[0].leaves_at, self._timeline.unheld(now))
