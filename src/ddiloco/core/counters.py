"""Counters that restart with the process: the one rule for adding them up.

A learner reports counters (tokens, busy seconds, bytes sent) that grow within an
*incarnation* (one process start) and start again from 0 when the process restarts. The work
of a learner is the sum over its incarnations of each one's largest reading; the fleet's is the
sum over learners. A reading that names no incarnation (an older record) takes a drop of the
counter as a restart. ``IncarnationCounters`` applies that rule online, one reading at a time,
and says what each reading added and over which interval, so a total, a per-learner total and
a series over time all come from the same rule.

Readings come from files and the network: anything that is not a finite, non-negative,
bounded number (NaN, a negative or huge value, a boolean, a string) is ignored, as is a reading
without a valid learner id, incarnation or time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

MAX_COUNTER = float(2**53)
"""Largest reading believed (beyond it a float no longer counts in ones): a larger one is damage."""
MAX_ID = 2**63 - 1
"""Largest learner id or incarnation believed."""


@dataclass(frozen=True)
class Increment:
    """What one accepted reading added to its learner's total."""

    learner: int
    """Learner id."""
    incarnation: int | None
    """The incarnation it named (None: an older reading without one)."""
    start: float
    """Start of the interval the increment was made in: the learner's previous reading, or for
    the first reading of an incarnation, the later of that and ``end - amount`` (for a counter of
    seconds, the latest the work can have started)."""
    end: float
    """Time of the reading."""
    amount: float
    """What it added (0 when the counter did not grow, or the reading was older than its
    incarnation's largest one: out of order)."""


def _number(value: object, low: float, high: float) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int) and abs(value) > MAX_ID:  # float() of a huge int overflows
        return None
    number = float(value)
    return number if math.isfinite(number) and low <= number <= high else None


def _identifier(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ID:
        return None
    return value


class IncarnationCounters:
    """One cumulative counter over learners and their incarnations (see the module's doc).

    Readings naming their incarnation may come in any order: each incarnation counts its largest
    reading once. Readings without one are taken in the order given (a drop is a restart), so
    give those in time order (``of_records`` does). Memory grows with learners and
    incarnations, not with readings."""

    def __init__(self, origin: float = 0.0) -> None:
        """``origin``: when the counters started (seconds; the run's start), the earliest start
        of a learner's first interval."""
        self.origin = origin
        self._best: dict[tuple[int, int | None, int], float] = {}
        """Largest reading per (learner, incarnation, restarts seen without incarnations)."""
        self._last_time: dict[int, float] = {}
        """Per learner: the time of its latest reading."""
        self._last_plain: dict[int, float] = {}
        """Per learner: its last reading without an incarnation (a drop below it is a restart)."""
        self._drops: dict[int, int] = {}
        """Per learner: restarts seen as drops of readings without an incarnation."""
        self._totals: dict[int, float] = {}
        """Per learner: the sum over its incarnations."""

    def add(self, learner: object, incarnation: object, value: object, time: object) -> Increment | None:
        """Take one reading; returns what it added, or None when it was ignored (malformed)."""
        m, v, t = _identifier(learner), _number(value, 0.0, MAX_COUNTER), _number(time, -MAX_COUNTER, MAX_COUNTER)
        inc = _identifier(incarnation)
        if m is None or v is None or t is None or (inc is None and incarnation is not None):
            return None
        if inc is None:  # an older reading: a drop of the counter is a restart
            if v < self._last_plain.get(m, 0.0):
                self._drops[m] = self._drops.get(m, 0) + 1
            self._last_plain[m] = v
        key = (m, inc, self._drops.get(m, 0) if inc is None else 0)
        previous = self._last_time.get(m)
        best = self._best.get(key)
        if best is None:  # the incarnation's first reading: work since its counter was 0
            amount = v
            start = max(self.origin if previous is None else previous, t - v)
        else:
            amount = max(0.0, v - best)
            start = self.origin if previous is None else previous
        self._best[key] = v if best is None else max(best, v)
        self._totals[m] = self._totals.get(m, 0.0) + amount
        self._last_time[m] = t if previous is None else max(previous, t)
        return Increment(m, inc, min(start, t), t, amount)

    def best(self, learner: int, incarnation: int) -> float:
        """The largest reading taken of ``learner``'s ``incarnation`` (0.0: none)."""
        return self._best.get((learner, incarnation, 0), 0.0)

    def total(self) -> float:
        """The sum over learners and their incarnations."""
        return sum(self._totals.values())

    def per_learner(self) -> dict[int, float]:
        """Each learner's sum over its incarnations, by learner id."""
        return dict(sorted(self._totals.items()))

    def state(self) -> dict[str, list[list[float]]]:
        """What a restart needs to keep adding up (JSON-able): each incarnation's largest reading."""
        return {"best": [[m, inc, v] for (m, inc, drops), v in sorted(self._best.items(), key=repr)
                         if inc is not None]}  # fmt: skip

    def load_state(self, state: object) -> None:
        """Take back ``state()`` output, keeping the larger of each incarnation's reading (it
        comes from a file: malformed entries are skipped)."""
        entries = state.get("best") if isinstance(state, dict) else None
        for e in entries if isinstance(entries, list) else []:
            if not (isinstance(e, list) and len(e) == 3):
                continue
            m, inc, v = _identifier(e[0]), _identifier(e[1]), _number(e[2], 0.0, MAX_COUNTER)
            if m is None or inc is None or v is None:
                continue
            key = (m, inc, 0)
            old = self._best.get(key, 0.0)
            if v > old:
                self._best[key] = v
                self._totals[m] = self._totals.get(m, 0.0) + v - old

    def clip(self, learner: int, total: float) -> float:
        """Lower ``learner``'s sum over its incarnations to at most ``total`` (an audit found more
        than can be vouched for), taking the excess off its largest readings first; returns what
        was taken off (0.0: it was within ``total``)."""
        before = self._totals.get(learner, 0.0)
        excess = before - max(0.0, total)
        for key in sorted((k for k in self._best if k[0] == learner), key=lambda k: -self._best[k]):
            if excess <= 0:
                break
            cut = min(excess, self._best[key])
            self._best[key] -= cut
            self._totals[learner] -= cut
            excess -= cut
        return before - self._totals.get(learner, 0.0)

    def incarnations(self, learner: int) -> int:
        """How many incarnations of ``learner`` have been seen."""
        return sum(1 for m, _, _ in self._best if m == learner)

    @classmethod
    def of_records(
        cls, records: Iterable[Mapping[str, object]], key: str, origin: float = 0.0
    ) -> tuple[IncarnationCounters, list[Increment]]:
        """The counter ``key`` of records shaped like metrics/learners.jsonl lines (``learner``,
        ``incarnation``, ``time``, ``key``), taken in time order (ties: in the order given);
        returns the counters and every accepted reading's increment, in that order."""
        counters = cls(origin)
        timed = [(t, i, r) for i, r in enumerate(records) if (t := _number(r.get("time"), -MAX_COUNTER, MAX_COUNTER))
                 is not None]  # fmt: skip
        timed.sort(key=lambda x: (x[0], x[1]))
        out = []
        for _, _, r in timed:
            step = counters.add(r.get("learner"), r.get("incarnation"), r.get(key), r.get("time"))
            if step is not None:
                out.append(step)
        return counters, out
