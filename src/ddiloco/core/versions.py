"""A fragment's versions as the syncer keeps them: its current values, the recent versions it
still accepts contributions on, and its outer optimizer.

The syncer owns these (``core/syncer.py``); the admission pipeline reads them (a contribution's
base version, its fragment's norm) and never writes them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ddiloco.core.codec import Chain
from ddiloco.core.outer import OuterNesterov


def norm_of(values: Sequence[torch.Tensor]) -> float:
    """|values| over all pieces (one fragment's L2 norm)."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(v)) ** 2 for v in values))


@dataclass(frozen=True)
class FragmentRecord:
    """One fragment's durable state: what a restart needs to continue exactly where it was."""

    fragment: int
    """Fragment index."""
    version: int
    """Its version."""
    tokens_merged: int
    """Tokens merged into it so far."""
    values: list[torch.Tensor]
    """Its global values, one tensor per piece."""
    momentum: list[torch.Tensor] | None
    """The outer optimizer's momentum buffers (None before the first outer step)."""


@dataclass
class Version:
    """One version of a fragment the syncer still accepts contributions on."""

    number: int
    """The version (0 = the initial values)."""
    values: list[torch.Tensor]
    """Its values. Past versions keep only their buffer pieces (empty tensors stand for the
    parameters) unless the run anchors on the current version (``anchor = "current"``, an
    ablation): learners send deltas against their own base copy, so a parameter's past value
    is never needed, and keeping S of them would cost S times the model."""
    made_at: float
    """When it was made (-inf: the initial or a restored version)."""
    full: bool = True
    """Whether ``values`` holds the parameters too."""


@dataclass
class FragmentState:
    """Global values of one fragment, its recent versions and its outer optimizer."""

    version: int
    """Current version (0 = the initial values)."""
    history: deque[Version]
    """Its recent versions, newest last, at most keep_versions + 1 long (the current one full)."""
    outer: OuterNesterov
    """This fragment's outer optimizer."""
    tokens_merged: int = 0
    """Tokens merged into this fragment so far."""
    norm: float = 0.0
    """|Theta_p| of the current version (bounds the outer gradients against it)."""
    recent_norms: deque[float] = field(default_factory=lambda: deque(maxlen=32))
    """|delta| per step of its recent merged contributions (the robust screening's history)."""
    screen_rounds: int = 0
    """Merged rounds with steps so far (the history becomes a reference after round.SCREEN_ROUNDS)."""
    last_merged: int = 0
    """Learners merged with a positive weight in its last merge (fleet view only)."""
    last_grace_s: float = 0.0
    """The grace window of its last merged round (seconds)."""
    chain: Chain | None = None
    """The down-link chain (a lossy ``down_encoding`` only): what learners on it hold."""

    @property
    def values(self) -> list[torch.Tensor]:
        return self.history[-1].values

    def at(self, version: int) -> Version | None:
        """``version`` if it is still accepted as a base (None: too old, or never made)."""
        for v in self.history:
            if v.number == version:
                return v
        return None

    def made_at(self, version: int) -> float:
        """When ``version`` was made (-inf when unknown: the initial or a restored version)."""
        v = self.at(version)
        return v.made_at if v is not None else -math.inf

    def push(self, version: Version, keep_past_values: bool, buffers: Sequence[int]) -> None:
        """Make ``version`` the current one; the one before keeps only its buffer pieces unless
        ``keep_past_values``."""
        if self.history and not keep_past_values:
            last = self.history[-1]
            if last.full:
                kept = set(buffers)
                last.values = [v if i in kept else _GONE for i, v in enumerate(last.values)]
                last.full = False
        self.history.append(version)

    def record(self, p: int) -> FragmentRecord:
        """Its current durable state (it is fragment ``p``)."""
        return FragmentRecord(p, self.version, self.tokens_merged, self.values, self.outer.state_dict()["buffers"])

    def load(self, rec: FragmentRecord, take: bool = False) -> None:
        """Take back ``record`` output (older versions are not kept: contributions based on them
        are answered with the current value). ``take``: the record's tensors are its to keep."""
        self.version = rec.version
        self.tokens_merged = rec.tokens_merged
        self.history.clear()
        self.history.append(
            Version(rec.version, [v.float() if take else v.float().clone() for v in rec.values], -math.inf)
        )
        self.norm = norm_of(self.values)
        self.outer.load_state_dict({"buffers": rec.momentum}, take=take)
        if self.chain is not None:
            # What learners hold of versions served before is not known: deltas chain again only
            # from versions this process serves.
            self.chain = Chain(rec.version, self.values, start=rec.version + 1, keep=self.chain.keep)


_GONE = torch.empty(0)
"""What a past version holds in place of a parameter piece it no longer keeps."""
