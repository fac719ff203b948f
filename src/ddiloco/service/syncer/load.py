"""How much of a syncer shard's time its merges take (``RUN/metrics/syncer-load*.json``).

A round's merge time is the work of every call that fed it (each contribution is turned into
its outer gradient and added to the running merge as it arrives) plus the call that closed it
(the outer step); its durable write is counted apart. Set against the time between two merges
of the same fragment (the round's interval), it says whether the shard keeps up.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

KEPT = 2000
"""Recent rounds kept for the percentiles (the totals count every round)."""


def _p(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


class RoundLoad:
    """Per fragment, the work fed into its open round; per closed round, merge and write times."""

    def __init__(self, shard: int) -> None:
        self.shard = shard
        self._open: dict[int, float] = {}
        self._last_close: dict[int, float] = {}
        self.merge_s: deque[float] = deque(maxlen=KEPT)
        self.write_s: deque[float] = deque(maxlen=KEPT)
        self.interval_s: deque[float] = deque(maxlen=KEPT)
        self.rounds = 0
        self.work_total_s = 0.0

    def work(self, fragment: int | None, closed: Sequence[int], seconds: float) -> None:
        """A call of ``seconds`` that fed ``fragment``'s round (None: a timer) and closed ``closed``."""
        self.work_total_s += seconds
        if fragment is not None:
            self._open[fragment] = self._open.get(fragment, 0.0) + seconds
        elif closed:
            for p in closed:
                self._open[p] = self._open.get(p, 0.0) + seconds / len(closed)

    def persisted(self, closed: Sequence[int], seconds: float, now: float) -> None:
        """The rounds of ``closed`` were made durable in ``seconds`` at ``now``."""
        for p in closed:
            self.rounds += 1
            self.merge_s.append(self._open.pop(p, 0.0))
            self.write_s.append(seconds / len(closed))
            if p in self._last_close:
                self.interval_s.append(now - self._last_close[p])
            self._last_close[p] = now

    def to_dict(self) -> dict[str, Any]:
        merge, interval = list(self.merge_s), list(self.interval_s)
        mean_i = sum(interval) / len(interval) if interval else None
        mean_m = sum(merge) / len(merge) if merge else None
        return {
            "shard": self.shard,
            "rounds": self.rounds,
            "merge_s_mean": mean_m,
            "merge_s_p95": _p(merge, 0.95),
            "merge_s_max": max(merge) if merge else None,
            "write_s_mean": sum(self.write_s) / len(self.write_s) if self.write_s else None,
            "round_interval_s_mean": mean_i,
            "merge_share_of_interval": mean_m / mean_i if mean_m is not None and mean_i else None,
            "work_total_s": self.work_total_s,
        }
