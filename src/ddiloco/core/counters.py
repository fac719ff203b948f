"""Counters that restart with each incarnation, summed over restarts.

A learner reports counters (tokens, busy seconds, bytes) cumulative over its current process:
a restarted process counts from 0 again. The total over a run is, per learner and incarnation,
the largest value reported, summed. Readings come from the network and from files: anything
that is not a finite number >= 0 is ignored.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any


def _value(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    x = float(v)
    return x if math.isfinite(x) and x >= 0 else None


class IncarnationCounters:
    """Per (learner, incarnation), the largest reading of one cumulative counter."""

    def __init__(self) -> None:
        self.best: dict[tuple[Hashable, Hashable], float] = {}

    def update(self, learner: Hashable, incarnation: Hashable, value: object) -> None:
        """Take one reading (a malformed one is ignored)."""
        x = _value(value)
        if x is None:
            return
        key = (learner, incarnation)
        self.best[key] = max(self.best.get(key, 0.0), x)

    def total(self) -> float:
        """The sum over learners and incarnations."""
        return sum(self.best.values())

    def state(self) -> dict[str, Any]:
        """JSON-able: [[learner, incarnation, value], ...] (ids are kept as they are)."""
        return {"best": [[m, i, v] for (m, i), v in sorted(self.best.items(), key=repr)]}

    def load_state(self, state: Any) -> None:
        """Take back ``state()`` output; malformed entries are skipped (it comes from a file)."""
        entries = state.get("best") if isinstance(state, dict) else None
        for e in entries if isinstance(entries, list) else []:
            if isinstance(e, list) and len(e) == 3 and isinstance(e[0], (int, str)) and isinstance(e[1], (int, str)):
                self.update(e[0], e[1], e[2])
