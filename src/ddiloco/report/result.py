"""What a run produced, and the tape statistics every report shows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ddiloco.core.tape import Late, Rejection, RoundRecord, TapeRecord, parse_tape_record
from ddiloco.report.accounting import Goodput

Progress = Callable[[float, float, str], None]
"""A simulated run's progress, ``(done, total, unit)`` in the unit of the budget that ends it
("tokens processed" or "s of virtual time"): never a horizon the run may overrun."""


def summarise_tape(tape: Sequence[dict[str, Any] | TapeRecord], num_fragments: int) -> dict[str, float]:
    """Rounds per fragment, mean learners per merge, grace admissions, rejections, late answers.

    A merge is a round that made a new version with at least one entry that took part
    (``core.tape.was_merged``: weight > 0); an entry of weight 0 answered but took no part, so it
    is not counted as merged. ``tape`` holds typed records or the lines of a tape file: those come
    from files, so a malformed one is skipped, not trusted."""
    records = [r if isinstance(r, (RoundRecord, Rejection, Late)) else parse_tape_record(r) for r in tape]
    rounds = [r for r in records if isinstance(r, RoundRecord)]
    merges = [r for r in rounds if r.is_merge]
    return {
        "rounds_per_fragment": len(merges) / max(num_fragments, 1),
        "learners_per_merge": sum(len(r.took_part) for r in merges) / len(merges) if merges else 0.0,
        "grace_admissions": sum(1 for r in merges for m in r.took_part if m.in_grace),
        "rejected": sum(r.rejected_total for r in rounds) + sum(isinstance(r, Rejection) for r in records),
        "late": sum(isinstance(r, Late) for r in records),
    }


@dataclass
class RunResult:
    """Outcome of one run (simulated or real)."""

    method: str
    final_loss: float
    evals: list[dict[str, float]]
    horizon_s: float
    tokens_processed: int
    tokens_merged: float
    goodput: Goodput
    uptime: float
    lost_steps: float
    failures: int
    num_fragments: int
    rounds_per_fragment: float
    learners_per_merge: float
    grace_admissions: int
    rejected: int
    late: int
    tape: list[dict[str, Any]] = field(default_factory=list)
    log: list[dict[str, Any]] = field(default_factory=list)
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    """Per-learner records over time (metrics/learners.jsonl in the run folder format)."""
    num_learners: int = 0
    """M."""
    loss_unit: str = ""
    """The workload's loss unit ("nats/byte"; "" when it does not say)."""
    partial: bool = False
    """The run was interrupted before its budget was spent."""
    traffic: dict[str, Any] | None = None
    """What crossed the learners' links (``protocol.traffic.TrafficMeter.to_dict``;
    metrics/traffic.json; ``traffic_figures`` gives bytes per learner per step); None: not counted."""

    def summary(self) -> dict[str, Any]:
        """The scalar figures (what the table and summary.json show)."""
        return {
            "method": self.method,
            "eval_loss": self.final_loss,
            "tokens_processed": self.tokens_processed,
            "tokens_merged": self.tokens_merged,
            "merged_share": self.tokens_merged / self.tokens_processed if self.tokens_processed else 0.0,
            "goodput": self.goodput.goodput,
            "blocked": self.goodput.blocked,
            "down": self.goodput.down,
            "restarting": self.goodput.restarting,
            "starting": self.goodput.starting,
            "uptime": self.uptime,
            "lost_steps": self.lost_steps,
            "failures": self.failures,
            "num_fragments": self.num_fragments,
            "rounds_per_fragment": self.rounds_per_fragment,
            "learners_per_merge": self.learners_per_merge,
            "grace_admissions": self.grace_admissions,
            "rejected": self.rejected,
            "late": self.late,
            "run_time_s": self.horizon_s,
            "partial": self.partial,
        }
