"""The messages between learners and the syncer, as plain frozen dataclasses.

Drivers move these (in-process in the simulator, over ZeroMQ in the real runtime); the core
only ever sees and returns them. Every learner message carries the sender's *incarnation*
(one per process start), so the syncer can tell a restarted learner from its dead
predecessor's messages still in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch

from ddiloco.core.compress import Encoded

PayloadKind = Literal["values", "delta"]
UpdateReason = Literal["merged", "join", "stale"]

# Bounds of every numeric field, as dataclass field metadata: ``min``/``max`` bound the value (or
# each element of a list or dict of numbers), ``max_len`` the length of a string, list or dict.
# ``service/base/wire.py`` checks them on decode (a violation is a WireError naming field, value and
# range) and on encode (a bug cannot put an out-of-range message on the wire). Counters stop at
# 2**53 so that every one of them is exact as a float (token weights, JSON readers elsewhere).
MAX_ID = 65535
"""Largest learner id, fragment index or other small index."""
MAX_SERIAL = 2**63 - 1
"""Largest incarnation, sequence number or epoch (a signed 64-bit integer)."""
MAX_COUNT = 2**53
"""Largest version, step, token count, data position or round id."""
MAX_STEP_TIME_S = 86400.0
"""Longest inner step a heartbeat may report (a day); a too-small one is the syncer core's concern."""
MAX_TOKENS_F = 1e18
"""Largest global token count (a float)."""
MAX_BUSY_S = 1e10
"""Most seconds of inner steps a heartbeat may report (centuries: a bound, not a limit)."""
MAX_LOSS = 1e30
"""Largest training loss a heartbeat may report (a larger or non-finite one is reported unknown)."""
LOSS_UNKNOWN = -1.0
"""A heartbeat's ``loss`` when the learner has none (the wire is strict JSON: no null, no NaN)."""

ID: dict[str, Any] = {"min": 0, "max": MAX_ID}
SERIAL: dict[str, Any] = {"min": 0, "max": MAX_SERIAL}
COUNT: dict[str, Any] = {"min": 0, "max": MAX_COUNT}
STEP_TIME: dict[str, Any] = {"min": 0.0, "max": MAX_STEP_TIME_S}
MERGED_TOKENS: dict[str, Any] = {"min": 0.0, "max": MAX_TOKENS_F}
LIVE: dict[str, Any] = {"min": 1, "max": MAX_ID + 1}
BUSY: dict[str, Any] = {"min": 0.0, "max": MAX_BUSY_S}
LOSS: dict[str, Any] = {"min": LOSS_UNKNOWN, "max": MAX_LOSS}
VERSIONS: dict[str, Any] = {**COUNT, "max_len": MAX_ID + 1}


@dataclass(frozen=True)
class Join:
    """Learner -> syncer: register (a fresh process, or again after either side restarted)."""

    learner: int = field(metadata=ID)
    """Learner id."""
    incarnation: int = field(metadata=SERIAL)
    """The sending process's incarnation; a larger one replaces the registered one."""
    base_versions: list[int] = field(metadata=VERSIONS)
    """Version of each fragment the learner holds; empty for a fresh process (it needs all)."""


@dataclass(frozen=True)
class Leave:
    """Learner -> syncer: clean departure; stop counting me as live now."""

    learner: int = field(metadata=ID)
    """Learner id."""
    incarnation: int = field(metadata=SERIAL)
    """The departing process's incarnation."""


@dataclass(frozen=True)
class Heartbeat:
    """Learner -> syncer: I am alive; my recent inner-step duration and my progress so far.

    The progress fields (``tokens``, ``busy_s``, ``loss``, ``bytes_sent``) only feed the fleet
    view (``ddiloco status``, metrics/learners.jsonl); the algorithm never reads them. They are
    cumulative over the sending incarnation: they restart from 0 when its process restarts.
    """

    learner: int = field(metadata=ID)
    """Learner id."""
    incarnation: int = field(metadata=SERIAL)
    """The sending process's incarnation."""
    step: int = field(metadata=COUNT)
    """The learner's inner steps so far."""
    step_time_s: float = field(metadata=STEP_TIME)
    """Duration of the learner's recent inner steps (seconds; 0 if unknown yet)."""
    tokens: int = field(default=0, metadata=COUNT)
    """Tokens this incarnation has processed."""
    busy_s: float = field(default=0.0, metadata=BUSY)
    """Seconds this incarnation has spent in inner steps."""
    loss: float = field(default=LOSS_UNKNOWN, metadata=LOSS)
    """Its last training loss; ``LOSS_UNKNOWN`` (-1) when it has none (or it was not finite)."""
    bytes_sent: int = field(default=0, metadata=COUNT)
    """Bytes of contributions this incarnation has sent (every frame, per syncer shard)."""


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

    learner: int = field(metadata=ID)
    """Learner id."""
    incarnation: int = field(metadata=SERIAL)
    """The sending process's incarnation."""
    fragment: int = field(metadata=ID)
    """Fragment index p."""
    base_version: int = field(metadata=COUNT)
    """Version of p this learner last received (its anchor)."""
    seq: int = field(metadata=SERIAL)
    """Per-incarnation sequence number, increasing with every contribution built."""
    values: list[torch.Tensor]
    """One tensor per piece of the fragment: parameter values, or base minus values for 'delta'."""
    steps: int = field(metadata=COUNT)
    """Inner steps since the learner last received p."""
    tokens: int = field(metadata=COUNT)
    """Tokens processed since the learner last received p."""
    data_position: int = field(metadata=COUNT)
    """Batches of its shard consumed so far (recorded so a restart resumes there)."""
    step: int = field(metadata=COUNT)
    """The learner's inner step count when it answered."""
    kind: PayloadKind = "values"
    """'values' (theta) or 'delta' (local base minus theta, after lossy encoding). In a delta,
    buffers and counts still carry their values: statistics are levels, not progress."""
    encoded: list[Encoded] = field(default_factory=list)
    """What goes on the wire, one encoding per piece (``values`` are what it decodes to); empty:
    ``values`` go as they are."""
    routed: list[list[int]] = field(default_factory=list, metadata={**COUNT, "max_len": MAX_ID + 1})
    """Per piece, the tokens routed to each row (expert) of the piece's whole tensor since the
    learner last received p (``algo.expert_weights = "routed"``): one count per row of the
    tensor, each at most ``tokens``; empty for a piece without counts, and empty altogether
    when the learner sends none."""

    @property
    def identity(self) -> ContributionId:
        return ContributionId(self.learner, self.incarnation, self.fragment, self.base_version, self.seq)


@dataclass(frozen=True)
class Ack:
    """Learner -> syncer: I applied version v of fragment p (used to time the sync path)."""

    learner: int = field(metadata=ID)
    """Learner id."""
    incarnation: int = field(metadata=SERIAL)
    """The sending process's incarnation."""
    fragment: int = field(metadata=ID)
    """Fragment index."""
    version: int = field(metadata=COUNT)
    """The applied version."""


@dataclass(frozen=True)
class FragmentRequest:
    """Syncer -> learner: please send fragment p for round ``round_id``."""

    learner: int = field(metadata=ID)
    """Addressee."""
    fragment: int = field(metadata=ID)
    """Fragment index."""
    round_id: int = field(metadata=COUNT)
    """Round being collected."""


@dataclass(frozen=True)
class FragmentUpdate:
    """Syncer -> learner: the global value of fragment p at ``version``."""

    learner: int = field(metadata=ID)
    """Addressee."""
    fragment: int = field(metadata=ID)
    """Fragment index."""
    version: int = field(metadata=COUNT)
    """Global version of these values."""
    values: list[torch.Tensor]
    """One tensor per piece (shared, read-only: receivers copy into their own parameters)."""
    merged_tokens: float = field(metadata=MERGED_TOKENS)
    """Tokens merged into the global model so far (drives the inner LR schedule)."""
    live_learners: int = field(metadata=LIVE)
    """Live learners when sent (lets a learner extrapolate the global token count)."""
    global_step: int = field(default=0, metadata=COUNT)
    """Highest learner step the syncer has seen (aligns a rejoining lock-step learner)."""
    reason: UpdateReason = "merged"
    """Why it was sent: merged, join (a fetch), stale (the learner's base was too old)."""
    kind: PayloadKind = "values"
    """'values' (the version itself) or 'delta' (its change from ``base_version`` as the learner
    holds it: parameters add it, buffers and counts carry their values)."""
    base_version: int = field(default=0, metadata=COUNT)
    """For a delta: the version it applies to (the learner ignores a delta that does not chain)."""
    encoded: list[Encoded] = field(default_factory=list)
    """What goes on the wire, one encoding per piece (``values`` are what it decodes to); empty:
    ``values`` go as they are."""


LearnerMessage = Join | Leave | Heartbeat | Contribution | Ack
"""Everything a learner sends the syncer's core."""
SyncerMessage = FragmentRequest | FragmentUpdate
"""Everything the syncer's core sends a learner."""
