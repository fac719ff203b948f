"""``LearnerStats``: what a ``ddiloco.Learner`` did so far."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LearnerStats:
    """What a learner did so far (read it any time; it is updated by ``step()``)."""

    steps: int = 0
    """Calls to ``step()``."""
    tokens: int = 0
    """Tokens this learner processed (all ranks together)."""
    step_s: float = 0.0
    """Wall time between consecutive ``step()`` calls, summed: the training loop's time."""
    sync_s: float = 0.0
    """Wall time spent inside ``step()``, lock-step waits excepted: the API's cost."""
    blocked_s: float = 0.0
    """Wall time a lock-step (``late_fragment = wait``) learner waited inside ``step()``."""
    join_s: float = 0.0
    """Wall time the constructor waited for the join (registration and the global state)."""
    applied: int = 0
    """Global fragment versions written into the model."""
    loss: float | None = None
    """The last loss given to ``step(loss=...)`` (None: none yet)."""
    bytes_sent: int = 0
    """Bytes of contributions sent to the syncer so far (as of the last ``step()``)."""

    @property
    def busy_s(self) -> float:
        """Wall time in training steps: the loop's time between ``step()`` calls plus the time
        inside them, lock-step waits excepted: the definition of ``LearnerSession.busy_s``,
        which heartbeats report (a wait for a fragment is not busy)."""
        return self.step_s + self.sync_s
