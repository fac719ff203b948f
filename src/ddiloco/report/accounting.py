"""Where each learner's allocated time went: starting, computing, blocked, down or restarting."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

State = Literal["compute", "blocked", "down", "restarting", "starting"]
STATES: tuple[State, ...] = get_args(State)


@dataclass
class TimeAccount:
    """Time spent in each state by one learner (states change at event times).

    The simulator switches it at virtual event times; the launcher at the events it observes
    (spawned: starting or restarting, first inner step: compute, killed or died: down), so every
    second from ``since`` to ``close`` is in exactly one state and the shares add up to 1."""

    state: State = "compute"
    """The state it is in now."""
    since: float = 0.0
    """When it entered it (an account's time never goes back: see ``switch``)."""
    totals: dict[State, float] = field(default_factory=lambda: {s: 0.0 for s in STATES})
    """Seconds spent in each state before ``since``."""

    def switch(self, state: State, now: float) -> None:
        """Enter ``state`` at ``now``. An event observed late, at a time before the last switch,
        is taken at that switch (time spent is never negative)."""
        now = max(now, self.since)
        self.totals[self.state] += now - self.since
        self.state, self.since = state, now

    def close(self, now: float) -> None:
        self.switch(self.state, now)


@dataclass(frozen=True)
class Goodput:
    """Fleet-level shares of allocated learner-time (they add up to 1)."""

    goodput: float
    """Learner-time on inner steps / allocated learner-time."""
    blocked: float
    """Share spent waiting for fragments (lock-step baselines)."""
    down: float
    """Share spent down (failed, not yet restarting)."""
    restarting: float
    """Share spent restarting (process start, state fetch)."""
    starting: float = 0.0
    """Share its first process spent starting (the job's start-up: start to first inner step)."""


def fleet_goodput(accounts: list[TimeAccount], horizon_s: float) -> Goodput:
    alloc = horizon_s * len(accounts)
    if alloc <= 0:  # stopped before any time passed: nothing was allocated, nothing lost
        return Goodput(0.0, 0.0, 0.0, 0.0)
    tot = {s: sum(a.totals[s] for a in accounts) / alloc for s in STATES}
    return Goodput(tot["compute"], tot["blocked"], tot["down"], tot["restarting"], tot["starting"])


def uptime(outages: list[tuple[int, float, float]], num_learners: int, need: int, horizon_s: float) -> float:
    """Share of [0, horizon] during which at least ``need`` learners are not in an outage."""
    if horizon_s <= 0:
        return 1.0
    edges = sorted([(s, -1) for _, s, _ in outages] + [(e, +1) for _, _, e in outages])
    up, last, good = num_learners, 0.0, 0.0
    for t, d in edges:
        t = min(max(t, 0.0), horizon_s)
        if up >= need:
            good += t - last
        up, last = up + d, t
    if up >= need:
        good += horizon_s - last
    return good / horizon_s
