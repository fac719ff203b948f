"""The emulated links of ``chaos.links`` and ``chaos.site_link``, in virtual time.

The real runtime puts a relay in front of each learner named there (``ddiloco.link``); the
simulator, given the same config, puts the same link on that learner's messages, so that it
predicts what the link does to rounds and merges. A message is a whole: it waits for its link
(a FIFO server at the link's rate, shared with every learner's traffic that way when a site
link caps them all), is held ``stall_s`` for each of its chunks that stalls (a binomial draw
per message, the relay's chance per chunk), then takes the one-way latency with its jitter, and
never arrives before the message ahead of it on the same connection. The relay's own overhead,
and the link faults (holds, cuts, resets), are not modelled here: the simulator has its own
partitions (``sim/faults.py``).
"""

from __future__ import annotations

import numpy as np

from ddiloco.chaos.schedule import ChaosConfig, link_plan
from ddiloco.link.config import DirectionConfig, LinkConfig, parse_link, parse_site_rate

Direction = str  # "up" (learner to syncer) or "down"


class SimLinks:
    """Per learner and direction, when a message sent now arrives."""

    def __init__(self, cfg: ChaosConfig, num_learners: int, rng: np.random.Generator) -> None:
        plan = link_plan(cfg, num_learners) if cfg.enabled else {}
        self.links: dict[int, LinkConfig] = {m: parse_link(spec) for m, (spec, _) in plan.items()}
        self.site_bps = parse_site_rate(cfg.site_link) if cfg.enabled and cfg.site_link else 0.0
        self.rng = rng
        self._free: dict[tuple[int, Direction], float] = {}  # when each link is next free to send
        self._site_free: dict[Direction, float] = {}

    def covers(self, learner: int) -> bool:
        """Whether ``learner``'s messages go over an emulated link."""
        return learner in self.links

    def transfer_end(self, now: float, learner: int, direction: Direction, nbytes: int) -> float:
        """When a message of ``nbytes`` sent at ``now`` has crossed the learner's link (before the
        caller keeps the connection's order)."""
        link = self.links[learner]
        d: DirectionConfig = link.up if direction == "up" else link.down
        rates = [r for r in (d.rate_bps, self.site_bps) if r > 0]
        start = max(now, self._free.get((learner, direction), 0.0))
        if self.site_bps > 0:
            start = max(start, self._site_free.get(direction, 0.0))
        done = start + (nbytes * 8 / min(rates) if rates else 0.0)
        if d.stall_prob > 0 and d.stall_s > 0:
            chunks = max(1, -(-nbytes // link.chunk_bytes))
            done += int(self.rng.binomial(chunks, d.stall_prob)) * d.stall_s  # everything behind waits too
        self._free[(learner, direction)] = done
        if self.site_bps > 0:
            self._site_free[direction] = done
        jitter = float(self.rng.uniform(-d.jitter_s, d.jitter_s)) if d.jitter_s > 0 else 0.0
        return done + d.latency_s + jitter

    def rate(self, learner: int, direction: Direction) -> float:
        """The bytes per second the learner's emulated link carries (the site link's, when
        slower); 0: not limited."""
        link = self.links[learner]
        d: DirectionConfig = link.up if direction == "up" else link.down
        rates = [r for r in (d.rate_bps, self.site_bps) if r > 0]
        return min(rates) / 8 if rates else 0.0


class HandoffQueues:
    """Each learner's optimizer hand-off as its comm thread sends it (``service/learner/
    handoff_sender.py``): the pieces one after another on its link, behind nothing else, and
    what of them is done (arrived, or lost to a partition), for ``LearnerSession.sending``."""

    def __init__(self) -> None:
        self._free: dict[int, float] = {}  # when each learner's hand-off has its link to itself again
        self._pending: dict[int, list[tuple[float, int]]] = {}  # (done at, bytes), in order
        self._done: dict[int, int] = {}

    def start(self, learner: int) -> None:
        """A new process: its running total starts again (its session's does)."""
        self._pending[learner], self._done[learner] = [], 0

    def wait_s(self, learner: int, now: float, nbytes: int, rate: float) -> float:
        """How long a piece of ``nbytes`` sent at ``now`` waits for the pieces ahead of it on a
        link of ``rate`` bytes per second (its own transfer is the caller's)."""
        start = max(now, self._free.get(learner, now))
        self._free[learner] = start + (nbytes / rate if rate > 0 else 0.0)
        return start - now

    def sent(self, learner: int, done_at: float, nbytes: int) -> None:
        self._pending.setdefault(learner, []).append((done_at, nbytes))

    def lost(self, learner: int, nbytes: int) -> None:
        self._done[learner] = self._done.get(learner, 0) + nbytes

    def done(self, learner: int, now: float) -> int:
        """Bytes of the learner's hand-off pieces done by ``now`` (this process)."""
        pending = self._pending.get(learner, [])
        while pending and pending[0][0] <= now:
            self._done[learner] = self._done.get(learner, 0) + pending.pop(0)[1]
        return self._done.get(learner, 0)
