"""The messages between learners and the syncer, as plain frozen dataclasses.

Drivers move these (in-process in the simulator, over ZeroMQ in the real runtime); the core
only ever sees and returns them. Every learner message carries the sender's *incarnation*
(one per process start), so the syncer can tell a restarted learner from its dead
predecessor's messages still in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

PayloadKind = Literal["values", "delta"]
UpdateReason = Literal["merged", "join", "stale"]


@dataclass(frozen=True)
class Join:
    """Learner -> syncer: register (a fresh process, or again after either side restarted)."""

    learner: int
    """Learner id."""
    incarnation: int
    """The sending process's incarnation; a larger one replaces the registered one."""
    base_versions: list[int]
    """Version of each fragment the learner holds; empty for a fresh process (it needs all)."""


@dataclass(frozen=True)
class Leave:
    """Learner -> syncer: clean departure; stop counting me as live now."""

    learner: int
    """Learner id."""
    incarnation: int
    """The departing process's incarnation."""


@dataclass(frozen=True)
class Heartbeat:
    """Learner -> syncer: I am alive; my recent inner-step duration."""

    learner: int
    """Learner id."""
    incarnation: int
    """The sending process's incarnation."""
    step: int
    """The learner's inner steps so far."""
    step_time_s: float
    """Duration of the learner's recent inner steps (seconds; 0 if unknown yet)."""


class ContributionId(NamedTuple):
    """What makes a contribution unique: a replay or duplicate has the same identity."""

    learner: int
    incarnation: int
    fragment: int
    base_version: int
    seq: int


@dataclass(frozen=True)
class Contribution:
    """Learner -> syncer: my current values of fragment p (or my delta against my base).

    Built only by ``LearnerCore.contribution``, which numbers them.
    """

    learner: int
    """Learner id."""
    incarnation: int
    """The sending process's incarnation."""
    fragment: int
    """Fragment index p."""
    base_version: int
    """Version of p this learner last received (its anchor)."""
    seq: int
    """Per-incarnation sequence number, increasing with every contribution built."""
    values: list[torch.Tensor]
    """One tensor per piece of the fragment: parameter values, or base minus values for 'delta'."""
    steps: int
    """Inner steps since the learner last received p."""
    tokens: int
    """Tokens processed since the learner last received p."""
    data_position: int
    """Batches of its shard consumed so far (recorded so a restart resumes there)."""
    step: int
    """The learner's inner step count when it answered."""
    kind: PayloadKind = "values"
    """'values' (theta) or 'delta' (local base minus theta, e.g. after lossy encoding)."""

    @property
    def identity(self) -> ContributionId:
        return ContributionId(self.learner, self.incarnation, self.fragment, self.base_version, self.seq)


@dataclass(frozen=True)
class Ack:
    """Learner -> syncer: I applied version v of fragment p (used to time the sync path)."""

    learner: int
    """Learner id."""
    incarnation: int
    """The sending process's incarnation."""
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
    reason: UpdateReason = "merged"
    """Why it was sent: merged, join (a fetch), stale (the learner's base was too old)."""


LearnerMessage = Join | Leave | Heartbeat | Contribution | Ack
"""Everything a learner sends the syncer's core."""
SyncerMessage = FragmentRequest | FragmentUpdate
"""Everything the syncer's core sends a learner."""
