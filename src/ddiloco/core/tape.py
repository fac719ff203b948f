"""The event tape: typed records of what the syncer decided, returned to the driver to keep.

The core never stores the tape; each ``Syncer`` call returns the records it produced and the
driver appends them to a file (service) or a list (simulator). ``to_json`` gives the line
written to ``tape.jsonl``; ``ddiloco.report.tape`` reads such lines back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

CloseReason = Literal["all_answered", "grace_over", "quorum", "flush", "final", "no_live_learners"]
RejectReason = Literal[
    "unknown_learner",
    "stale_incarnation",
    "duplicate",
    "bad_fragment",
    "bad_version",
    "stale_base",
    "bad_counters",
    "bad_payload",
    "bad_norm",
    "outlier",
    "implausible",
    "quarantined",
]
MAX_REJECTIONS_PER_ROUND = 32
"""Rejections listed in one round record; more are only counted (the record stays bounded)."""


@dataclass(frozen=True)
class Rejection:
    """A contribution refused before it could touch global state."""

    learner: int
    """Sender (as claimed)."""
    fragment: int
    """Fragment (as claimed)."""
    reason: RejectReason
    """Why, as a stable keyword (counted by kind)."""
    detail: str
    """Why, for a human."""
    time: float
    """When (the time the core was given)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "event": "rejected",
            "learner": self.learner,
            "fragment": self.fragment,
            "reason": self.reason,
            "detail": self.detail,
            "time": self.time,
        }


@dataclass(frozen=True)
class Late:
    """A valid contribution that arrived when its fragment had no open round (kept for later)."""

    learner: int
    """Sender."""
    fragment: int
    """Fragment."""
    time: float
    """When."""

    def to_json(self) -> dict[str, Any]:
        return {"event": "late", "learner": self.learner, "fragment": self.fragment, "time": self.time}


@dataclass(frozen=True)
class MergedEntry:
    """One learner's part in a closed round."""

    learner: int
    """Learner id."""
    incarnation: int
    """Its incarnation."""
    seq: int
    """The contribution's sequence number."""
    base_version: int
    """The version it was anchored at."""
    staleness: int
    """Versions between its base and the one this round replaced."""
    weight: float
    """Its token weight tokens^2/steps (0: it took no part in the merge)."""
    tokens: int
    """Tokens it brought."""
    steps: int
    """Inner steps it brought."""
    in_grace: bool
    """Whether it arrived inside the grace window (after the quorum)."""
    clipped: bool = False
    """Whether its weight was clipped at weight_cap x the median (its tokens with it)."""
    norm: float = 0.0
    """L2 norm of its outer gradient."""

    @property
    def was_merged(self) -> bool:
        """It took part in the merge (an answer of weight 0, e.g. no steps, did not)."""
        return self.weight > 0

    @classmethod
    def from_json(cls, d: Any) -> MergedEntry | None:
        """Back from ``to_json`` output (None when ``d`` is not one: records come from files)."""
        if not isinstance(d, dict):
            return None
        try:
            return cls(
                _int(d["learner"]), _int(d["incarnation"]), _int(d["seq"]), _int(d["base_version"]),
                _int(d["staleness"]), _num(d["weight"]), _int(d["tokens"]), _int(d["steps"]), bool(d["in_grace"]),
                bool(d.get("clipped", False)), _num(d.get("norm", 0.0)),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError):
            return None

    def to_json(self) -> dict[str, Any]:
        return {
            "learner": self.learner,
            "incarnation": self.incarnation,
            "seq": self.seq,
            "base_version": self.base_version,
            "staleness": self.staleness,
            "weight": self.weight,
            "tokens": self.tokens,
            "steps": self.steps,
            "in_grace": self.in_grace,
            "clipped": self.clipped,
            "norm": self.norm,
        }


@dataclass
class RoundRecord:
    """One closed round."""

    fragment: int
    """Fragment index."""
    round_id: int
    """Round id (increasing over the run)."""
    opened_at: float
    """Time the round opened."""
    closed_at: float
    """Time it closed."""
    version: int
    """Version produced (unchanged when nothing was merged)."""
    quorum: int
    """Effective quorum K_eff when the round closed."""
    grace_s: float
    """Length of the grace window granted (0 without one)."""
    close_reason: CloseReason
    """Why the round closed."""
    merged: list[MergedEntry] = field(default_factory=list)
    """Per contributing learner, in learner order."""
    rejected: list[Rejection] = field(default_factory=list)
    """Contributions refused while this round was open (at most MAX_REJECTIONS_PER_ROUND)."""
    rejected_total: int = 0
    """All contributions refused while this round was open."""

    @classmethod
    def from_json(cls, d: Any) -> RoundRecord | None:
        """Back from ``to_json`` output (None when ``d`` is not a round record; malformed merged
        entries are dropped: records come from files)."""
        if not isinstance(d, dict) or d.get("event") != "round":
            return None
        try:
            reason = str(d["close_reason"])
            if reason not in get_args(CloseReason):
                return None
            entries = d.get("merged", [])
            merged = [e for e in (MergedEntry.from_json(x) for x in entries if isinstance(entries, list)) if e]
            return cls(
                _int(d["fragment"]), _int(d["round"]), _num(d["opened_at"]), _num(d["closed_at"]), _int(d["version"]),
                _int(d["quorum"]), _num(d["grace_s"]), cast(CloseReason, reason), merged,
                rejected_total=_int(d.get("rejected_total", 0)),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError):
            return None

    def to_json(self) -> dict[str, Any]:
        return {
            "event": "round",
            "fragment": self.fragment,
            "round": self.round_id,
            "opened_at": self.opened_at,
            "closed_at": self.closed_at,
            "version": self.version,
            "quorum": self.quorum,
            "grace_s": self.grace_s,
            "close_reason": self.close_reason,
            "merged": [m.to_json() for m in self.merged],
            "rejected": [r.to_json() for r in self.rejected],
            "rejected_total": self.rejected_total,
        }


TapeRecord = RoundRecord | Rejection | Late


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {v!r}")
    return int(v)


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"expected a number, got {v!r}")
    return float(v)
