"""The event tape: typed records of what the syncer decided, returned to the driver to keep.

The core never stores the tape; each ``Syncer`` call returns the records it produced and the
driver appends them to a file (service) or a list (simulator). ``to_json`` gives the line
written to ``tape.jsonl``; ``parse_tape_record`` (``from_json``) reads such a line back into its
type, and ``ddiloco.report.tape`` reads whole files. ``was_merged`` is the one rule for "this
entry took part in the merge".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
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
    "bad_buffer",
    "outlier",
    "misaligned",
    "implausible",
    "quarantined",
]
MAX_REJECTIONS_PER_ROUND = 32
"""Rejections listed in one round record; more are only counted (the record stays bounded)."""
MAX_READ_INT = 2**63 - 1
"""Largest integer a read record may hold (a larger one is damage, and would overflow a float sum)."""
CLOSE_REASONS: frozenset[str] = frozenset(get_args(CloseReason))
REJECT_REASONS: frozenset[str] = frozenset(get_args(RejectReason))


class _Malformed(Exception):
    """A record read back does not have the fields and types its writer gives it."""


def _int(d: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value: object = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > MAX_READ_INT:
        raise _Malformed(key)
    return value


def _float(d: Mapping[str, Any], key: str, default: float | None = None) -> float:
    value: object = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Malformed(key)
    if isinstance(value, int) and abs(value) > MAX_READ_INT:  # float() of a huge int overflows
        raise _Malformed(key)
    number = float(value)
    if not math.isfinite(number):
        raise _Malformed(key)
    return number


def _bool(d: Mapping[str, Any], key: str, default: bool | None = None) -> bool:
    value: object = d.get(key, default)
    if not isinstance(value, bool):
        raise _Malformed(key)
    return value


def _str(d: Mapping[str, Any], key: str, default: str | None = None) -> str:
    value: object = d.get(key, default)
    if not isinstance(value, str):
        raise _Malformed(key)
    return value


def _list(d: Mapping[str, Any], key: str) -> list[Any]:
    value: object = d.get(key, [])
    if not isinstance(value, list):
        raise _Malformed(key)
    return value


def _reject_reason(d: Mapping[str, Any]) -> RejectReason:
    reason = _str(d, "reason")
    if reason not in REJECT_REASONS:
        raise _Malformed("reason")
    return cast(RejectReason, reason)


def _close_reason(d: Mapping[str, Any]) -> CloseReason:
    reason = _str(d, "close_reason")
    if reason not in CLOSE_REASONS:
        raise _Malformed("close_reason")
    return cast(CloseReason, reason)


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

    @classmethod
    def from_json(cls, d: object) -> Rejection | None:
        """The rejection ``to_json`` wrote, or None when ``d`` is not one (see ``parse_tape_record``)."""
        try:
            return cls._read(d)
        except _Malformed:
            return None

    @classmethod
    def _read(cls, d: object) -> Rejection:
        if not isinstance(d, Mapping):
            raise _Malformed("not an object")
        return cls(_int(d, "learner"), _int(d, "fragment"), _reject_reason(d), _str(d, "detail", ""), _float(d, "time"))


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

    @classmethod
    def from_json(cls, d: object) -> Late | None:
        """The record ``to_json`` wrote, or None when ``d`` is not one (see ``parse_tape_record``)."""
        if not isinstance(d, Mapping):
            return None
        try:
            return cls(_int(d, "learner"), _int(d, "fragment"), _float(d, "time"))
        except _Malformed:
            return None


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
    """L2 norm of its outer gradient (as merged: after any size clipping)."""
    scaled: float = 1.0
    """The robust merge's size clipping of its outer gradient (1: merged at its own size)."""
    alignment: float = 1.0
    """The robust merge's alignment: its cosine with the round's centre over the round's median
    cosine (1 also when the round had no centre: fewer than 3 answers, or robust off)."""
    drift: float = 0.0
    """The robust merge's drift of its learner in this fragment after it: the push it repeats
    over rounds off the centre, over the round's median drift (0: not judged)."""

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
            "scaled": self.scaled,
            "alignment": self.alignment,
            "drift": self.drift,
        }

    @property
    def was_merged(self) -> bool:
        """Whether it took part in the merge (see ``was_merged``)."""
        return was_merged(self)

    @classmethod
    def from_json(cls, d: object) -> MergedEntry | None:
        """The entry ``to_json`` wrote, or None when ``d`` is not one (see ``parse_tape_record``)."""
        try:
            return cls._read(d)
        except _Malformed:
            return None

    @classmethod
    def _read(cls, d: object) -> MergedEntry:
        if not isinstance(d, Mapping):
            raise _Malformed("not an object")
        return cls(
            learner=_int(d, "learner"),
            incarnation=_int(d, "incarnation"),
            seq=_int(d, "seq"),
            base_version=_int(d, "base_version"),
            staleness=_int(d, "staleness"),
            weight=_float(d, "weight"),
            tokens=_int(d, "tokens"),
            steps=_int(d, "steps"),
            in_grace=_bool(d, "in_grace"),
            clipped=_bool(d, "clipped", False),  # older tapes lack the last four
            norm=_float(d, "norm", 0.0),
            scaled=_float(d, "scaled", 1.0),
            alignment=_float(d, "alignment", 1.0),
            drift=_float(d, "drift", 0.0),
        )


def was_merged(entry: MergedEntry) -> bool:
    """The one rule for "this entry took part in the merge": a positive token weight. An entry of
    weight 0 answered the round (it is on the tape) but moved nothing."""
    return entry.weight > 0


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

    @property
    def took_part(self) -> list[MergedEntry]:
        """The entries that took part in the merge (``was_merged``), in learner order."""
        return [m for m in self.merged if was_merged(m)]

    @property
    def is_merge(self) -> bool:
        """Whether the round merged something: it made a version and an entry took part."""
        return self.version > 0 and any(was_merged(m) for m in self.merged)

    @classmethod
    def from_json(cls, d: object) -> RoundRecord | None:
        """The round ``to_json`` wrote, or None when ``d`` is not one (see ``parse_tape_record``).
        One malformed entry makes the whole round malformed: a round is not half trusted."""
        try:
            return cls._read(d)
        except _Malformed:
            return None

    @classmethod
    def _read(cls, d: object) -> RoundRecord:
        if not isinstance(d, Mapping):
            raise _Malformed("not an object")
        rejected = [Rejection._read(r) for r in _list(d, "rejected")]
        return cls(
            fragment=_int(d, "fragment"),
            round_id=_int(d, "round"),
            opened_at=_float(d, "opened_at"),
            closed_at=_float(d, "closed_at"),
            version=_int(d, "version"),
            quorum=_int(d, "quorum"),
            grace_s=_float(d, "grace_s"),
            close_reason=_close_reason(d),
            merged=[MergedEntry._read(m) for m in _list(d, "merged")],
            rejected=rejected,
            rejected_total=_int(d, "rejected_total", len(rejected)),  # older tapes only listed them
        )


TapeRecord = RoundRecord | Rejection | Late


def parse_tape_record(d: object) -> TapeRecord | None:
    """A tape line (a dict from JSON) as its typed record, or None when it is not a well-formed
    one: records come from files, so a malformed one is skipped, never trusted, and never
    raises. Unknown keys (``wall_offset``) are ignored; numbers must be finite and bounded."""
    if not isinstance(d, Mapping):
        return None
    event = d.get("event")
    if event == "round":
        return RoundRecord.from_json(d)
    if event == "rejected":
        return Rejection.from_json(d)
    if event == "late":
        return Late.from_json(d)
    return None
