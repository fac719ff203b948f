"""The messages between learners and the syncer, as plain dataclasses.

Runtimes move these (in-process in the simulator, over ZeroMQ in the real runtime); the core
only ever sees and returns them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Heartbeat:
    """Learner -> syncer: I am alive; my recent inner-step duration."""

    learner: int
    """Learner id."""
    step: int
    """The learner's inner steps so far."""
    step_time_s: float
    """Duration of the learner's recent inner steps (seconds; 0 if unknown yet)."""


@dataclass(frozen=True)
class Contribution:
    """Learner -> syncer: my current values of fragment p (or my delta against my base)."""

    learner: int
    """Learner id."""
    fragment: int
    """Fragment index p."""
    base_version: int
    """Version of p this learner last received (its anchor)."""
    values: list[torch.Tensor]
    """One tensor per piece of the fragment: parameter values, or base minus values for 'delta'."""
    steps: int
    """Inner steps since the learner last received p."""
    tokens: int
    """Tokens processed since the learner last received p."""
    data_position: int = 0
    """Batches of its shard consumed so far (recorded so a restart resumes there)."""
    step: int = 0
    """The learner's inner step count when it answered."""
    kind: str = "values"
    """'values' (theta) or 'delta' (local base minus theta, e.g. after lossy encoding)."""


@dataclass(frozen=True)
class Ack:
    """Learner -> syncer: I applied version v of fragment p (used to time the sync path)."""

    learner: int
    """Learner id."""
    fragment: int
    """Fragment index."""
    version: int
    """The applied version."""


@dataclass(frozen=True)
class FragmentRequest:
    """Syncer -> learner: please send fragment p for round ``round_id``."""

    learner: int
    """Addressee."""
    fragment: int
    """Fragment index."""
    round_id: int
    """Round being collected."""


@dataclass(frozen=True)
class FragmentUpdate:
    """Syncer -> learner: the global value of fragment p at ``version``."""

    learner: int
    """Addressee."""
    fragment: int
    """Fragment index."""
    version: int
    """Global version of these values."""
    values: list[torch.Tensor]
    """One tensor per piece (shared, read-only: receivers copy into their own parameters)."""
    global_tokens: float
    """Tokens merged into the global model so far (drives the inner LR schedule)."""
    live_learners: int
    """Live learners when sent (lets a learner extrapolate the global token count)."""
    global_step: int = 0
    """Highest learner step the syncer has seen (aligns a rejoining lock-step learner)."""
    reason: str = "merged"
    """Why it was sent: merged, join (a fetch), stale (the learner's base was too old)."""


@dataclass
class Rejection:
    """A contribution refused before it could touch global state."""

    learner: int
    """Sender (as claimed)."""
    fragment: int
    """Fragment (as claimed)."""
    reason: str
    """Why it was refused."""
    time: float
    """When (the time the core was given)."""

    def to_json(self) -> dict:
        return {"event": "rejected", "learner": self.learner, "fragment": self.fragment, "reason": self.reason, "time": self.time}


@dataclass
class RoundRecord:
    """One closed round, as appended to the event tape."""

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
    merged: list[dict] = field(default_factory=list)
    """Per merged learner: learner, base_version, staleness, weight, tokens, steps, in_grace."""
    quorum: int = 0
    """Effective quorum K_eff when the round closed."""
    grace_s: float = 0.0
    """Length of the grace window granted (0 without one)."""
    close_reason: str = ""
    """all_answered, grace_over, quorum (no grace), flush, or no_live_learners."""
    rejected: list[dict] = field(default_factory=list)
    """Contributions refused while this round was open, with reasons."""

    def to_json(self) -> dict:
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
            "merged": self.merged,
            "rejected": self.rejected,
        }
