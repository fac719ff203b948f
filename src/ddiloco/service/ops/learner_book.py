"""One learner's books in ``ddiloco train``: where its time went, across its incarnations.

The launcher calls these at the events it sees itself (a spawn, a kill or an exit, the run's
end) and at the one it reads from the learner (its first inner step: the status file is
written at once after it, with the time). Time is kept by a ``TimeAccount``, so every second
of the learner's allocation is in exactly one state, whatever the sampling of status files:
"starting" (the job's start-up) -> "compute" -> "down" (killed or died) -> "restarting"
(respawned) -> "compute" ... until ``close`` at the run's end. Work (steps, tokens) is what
each incarnation's last status said, taken once per process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ddiloco.report.accounting import TimeAccount


@dataclass
class LearnerBook:
    """Per-learner accounting across its incarnations."""

    account: TimeAccount = field(default_factory=lambda: TimeAccount("starting"))
    """Where its time went (states switched at the events below)."""
    steps: int = 0
    """Inner steps of its incarnations, from their last status files."""
    tokens: int = 0
    """Tokens of its incarnations, from their last status files."""
    banked_pid: int | None = None
    """The process whose last status is already in ``steps`` and ``tokens``."""
    failures: int = 0
    """Kills and abnormal exits."""
    restart_spawned: float | None = None
    """While a respawned incarnation has not stepped yet: when it was spawned."""
    restart_latencies: list[float] = field(default_factory=list)
    """Per restart that stepped: seconds from the respawn to its first inner step."""
    lost_steps: float = 0.0
    """Steps it had not yet had merged back when it died (from its last status)."""
    outages: list[tuple[float, float]] = field(default_factory=list)
    """(death, first step after; inf while not back), as times on the launcher's clock."""

    @classmethod
    def starting_at(cls, t: float) -> LearnerBook:
        """A learner whose allocated time starts at ``t`` (the job's start-up until its first step)."""
        return cls(account=TimeAccount("starting", t))

    def first_step(self, t: float) -> None:
        """Its current incarnation made its first inner step at ``t``: computing from then (no-op
        unless it was starting or restarting)."""
        if self.account.state not in ("starting", "restarting"):
            return
        if self.account.state == "restarting" and self.restart_spawned is not None:
            self.restart_latencies.append(max(0.0, t - self.restart_spawned))
        self.restart_spawned = None
        if self.outages and math.isinf(self.outages[-1][1]):
            self.outages[-1] = (self.outages[-1][0], t)
        self.account.switch("compute", t)

    def died(self, now: float, last_status: dict[str, Any] | None) -> None:
        """Killed or exited abnormally at ``now``; ``last_status``: the process's last status file."""
        if last_status is not None:
            self.bank(last_status)
            pending = last_status.get("pending_steps", 0.0)
            self.lost_steps += pending if isinstance(pending, (int, float)) else 0.0
        self.failures += 1
        self.account.switch("down", now)
        self.restart_spawned = None  # a restart that died before its first step has no latency
        if not self.outages or not math.isinf(self.outages[-1][1]):
            self.outages.append((now, math.inf))

    def respawned(self, at: float) -> None:
        """A new incarnation was started at ``at``: restarting until its first step."""
        self.account.switch("restarting", at)
        self.restart_spawned = at

    def bank(self, status: dict[str, Any]) -> None:
        """Add an incarnation's work from its status (once per process, however often called)."""
        pid = status.get("pid")
        if pid is None or pid == self.banked_pid:
            return
        self.banked_pid = pid
        for key in ("steps", "tokens"):
            value = status.get(key, 0)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(self, key, getattr(self, key) + value)

    def close(self, end: float) -> None:
        """The run ended at ``end``: its time stops counting."""
        self.account.close(end)
