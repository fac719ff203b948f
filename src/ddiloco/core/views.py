"""What a driver may read of the syncer's core: the fleet and the owned fragments, read-only
(``Syncer.view(now)``; the status file, ``StatusReply`` and the metrics are built from it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LearnerView:
    """One learner id as the syncer's core sees it (read-only)."""

    learner: int
    """Learner id."""
    incarnation: int
    """Its registered incarnation."""
    state: str
    """"up" (heard within the liveness timeout), "left" (said goodbye) or "down"."""
    last_heard: float
    """When it was last heard (core time)."""
    step_time_s: float | None
    """Its step-time EMA (None: none reported yet)."""
    last_contribution_at: float
    """When its last contribution was accepted into a round (-inf: none yet)."""
    held: tuple[tuple[int, int], ...]
    """(fragment, version) of each owned fragment it is known to hold."""


@dataclass(frozen=True)
class FragmentView:
    """One owned fragment as the syncer's core sees it (read-only)."""

    fragment: int
    """Fragment index."""
    version: int
    """Its current version."""
    made_at: float
    """When that version was made (-inf: the initial or a restored one)."""
    merged: int
    """Learners merged with a positive weight in its last merge."""
    grace_s: float
    """The grace window of its last merged round."""
    tokens_merged: int
    """Tokens merged into it so far."""
    open: bool
    """Whether a round of it is open."""


@dataclass(frozen=True)
class SyncerView:
    """What a driver may read of the syncer's core: the fleet and the owned fragments."""

    live: tuple[int, ...]
    """Live learners, sorted."""
    learners: tuple[LearnerView, ...]
    """Every registered learner id, sorted."""
    fragments: tuple[FragmentView, ...]
    """Every owned fragment, in order."""
    merged_tokens: float
    """Tokens merged into the global model (the mean over the owned fragments)."""
    learners_total: int = 0
    """Every registered learner id (``learners`` may list fewer)."""
