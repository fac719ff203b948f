"""The syncer's record of each learner id, and what liveness and the fleet's step time are.

The syncer keeps one ``LearnerInfo`` per registered id (``Syncer.learners``): whether it is
live, its step time, the replay guard, its strikes, quarantine and trust. The functions here
read those records; only the syncer writes them.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ddiloco.core.ema import Ema

STEP_CONSENSUS = 4.0
"""Step-time EMAs more than this factor from the live fleet's lower median do not drive the
step clock (honest fleets differ by less; ``max_speedup`` bounds claims at 8x)."""


@dataclass(frozen=True)
class JoinRefusal:
    """A join the syncer will not take."""

    learner: int
    """Who asked."""
    reason: str
    """Why, for a human."""
    retry_after_s: float
    """> 0: a passing condition (the id's holder may be gone soon): try again after this long;
    0: final (the learner must not retry)."""


@dataclass
class LearnerInfo:
    """What the syncer knows of one learner id."""

    incarnation: int
    """The registered process incarnation; messages of any other are not accepted."""
    last_heard: float
    """When the learner was last heard from (the core's time)."""
    step_time: Ema
    """EMA of its reported inner-step duration."""
    left: bool = False
    """Whether it left cleanly (not live until it joins again)."""
    data_position: int = 0
    """Batches of its shard consumed, as of its last merged contribution."""
    last_seq: dict[int, int] = field(default_factory=dict)
    """Per fragment, the highest sequence number accepted from this incarnation."""
    recent_weights: deque[float] = field(default_factory=lambda: deque(maxlen=8))
    """Token weights of its last accepted contributions (after clipping)."""
    strikes: int = 0
    """Contributions refused in a row for what they carried (not for arriving late or twice)."""
    quarantine: dict[int, int] | None = None
    """While quarantined: per fragment, the version its answers must start from again."""
    last_contribution_at: float = -math.inf
    """When its last contribution was accepted into a round (-inf: none yet)."""
    held: dict[int, int] = field(default_factory=dict)
    """Per owned fragment, the newest version it is known to hold (its join, acks, answers)."""
    trust: float = 1.0
    """The robust merge's trust in this id: an average of its answers' alignments over rounds.
    Kept across incarnations and restarts: re-registering does not reset it."""
    stale_served: dict[int, int] = field(default_factory=dict)
    """Per fragment, the version last sent in answer to a stale contribution (at most once each)."""

    def meta(self) -> dict[str, Any]:
        """What a restart keeps of it (JSON-able; ``Syncer.meta_state``)."""
        return {
            "data_position": self.data_position,
            "incarnation": self.incarnation,
            "last_seq": {str(p): s for p, s in self.last_seq.items()},
            "recent_weights": list(self.recent_weights),
            "trust": self.trust,
        }

    def load_meta(self, rec: Mapping[str, Any]) -> None:
        """Take back ``meta`` output (not live until it joins again)."""
        self.data_position = int(rec["data_position"])
        self.incarnation = int(rec["incarnation"])
        # Replays of contributions merged before the restart stay refused after it.
        self.last_seq = {int(p): int(s) for p, s in rec["last_seq"].items()}
        self.recent_weights.extend(float(w) for w in rec.get("recent_weights", []))
        trust = float(rec.get("trust", 1.0))
        self.trust = min(max(trust, 0.0), 1.0) if math.isfinite(trust) else 0.0


def live(learners: Mapping[int, LearnerInfo], now: float, timeout: float) -> list[int]:
    """Learners heard from within ``timeout`` of ``now`` (and not left), sorted."""
    return sorted(m for m, i in learners.items() if not i.left and now - i.last_heard <= timeout)


def step_time(times: Iterable[float | None]) -> float | None:
    """The fleet's step time from the live learners' step-time EMAs (None before any is known):
    their median over those within ``STEP_CONSENSUS`` x of the lower median, so half of the live
    learners reporting the largest allowed step time cannot stop the clock."""
    known = [t for t in times if t]
    if not known:
        return None
    low = statistics.median_low(known)
    return statistics.median(t for t in known if low / STEP_CONSENSUS <= t <= low * STEP_CONSENSUS)
