"""A learner's side of the protocol as a state machine (no model, no clock, no I/O).

It keeps per-fragment counters and base versions, says when to send which fragment, how to
apply a received one, and (for the lock-step baselines) when the training loop must wait.
The runtime owns the model and the optimizer and acts on these decisions.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import fragment_offset
from ddiloco.core.messages import FragmentUpdate


@dataclass(frozen=True)
class Answer:
    """Counters to send with fragment p (the runtime adds the values)."""

    fragment: int
    base_version: int
    steps: int
    tokens: int
    step: int


class LearnerCore:
    """Counters, send schedule, apply policy and blocking of one learner."""

    def __init__(self, cfg: DiLoCoConfig, learner: int, num_fragments: int) -> None:
        self.cfg = cfg
        self.learner = learner
        self.num_fragments = num_fragments
        self.step = 0
        self.steps = [0] * num_fragments
        self.tokens = [0] * num_fragments
        self.base_version = [0] * num_fragments
        self.tokens_processed = 0
        # Lock-step ('wait') learners: fragment -> step it was sent at, until it comes back.
        self.in_flight: dict[int, int] = {}
        self.blocked_since: dict[int, float] = {}
        # Inner LR schedule position, extrapolated from the syncer's global token count.
        self._global_tokens = 0.0
        self._fleet = 1
        self._own_since_update = 0

    # -- training progress ------------------------------------------------------------------

    def on_step(self, tokens: int) -> list[int]:
        """Count one finished inner step; return fragments a lock-step learner sends now."""
        self.step += 1
        self.tokens_processed += tokens
        self._own_since_update += tokens
        for p in range(self.num_fragments):
            self.steps[p] += 1
            self.tokens[p] += tokens
        if self.cfg.late_fragment != "wait":
            return []
        return [p for p in range(self.num_fragments) if self._due(p)]

    def _due(self, p: int) -> bool:
        phase = self.step % self.cfg.sync_every
        return phase == fragment_offset(p, self.num_fragments, self.cfg.sync_every) and p not in self.in_flight

    def answer(self, p: int) -> Answer:
        """Counters to send with fragment p now (in reply to a request, or on schedule)."""
        if self.cfg.late_fragment == "wait":
            self.in_flight[p] = self.step
        return Answer(p, self.base_version[p], self.steps[p], self.tokens[p], self.step)

    def lr_tokens(self) -> float:
        """Position of the inner LR schedule in global tokens: the syncer's merged count plus
        this learner's own tokens since, scaled by the fleet size it was told."""
        return self._global_tokens + self._fleet * self._own_since_update

    # -- receiving ---------------------------------------------------------------------------

    def on_update(self, u: FragmentUpdate) -> float | None:
        """Accept a global fragment: return the blend alpha to apply, or None to ignore it.

        Versions never go backwards: an update older than the learner's base is dropped. A
        fetch on join always overwrites (the local values may be arbitrary then).
        """
        p = u.fragment
        if u.version < self.base_version[p]:
            return None
        self.base_version[p] = u.version
        self.steps[p] = 0
        self.tokens[p] = 0
        self.in_flight.pop(p, None)
        self.blocked_since.pop(p, None)
        self._global_tokens = max(self._global_tokens, u.global_tokens)
        self._fleet = u.live_learners
        self._own_since_update = 0
        return 0.0 if u.reason != "merged" else self.cfg.alpha

    def on_rejoin(self, global_step: int) -> None:
        """After a restart: counters are empty and a lock-step learner aligns to the fleet."""
        self.steps = [0] * self.num_fragments
        self.tokens = [0] * self.num_fragments
        self.in_flight.clear()
        self.blocked_since.clear()
        if self.cfg.late_fragment == "wait":
            self.step = global_step

    # -- blocking (lock-step baselines only) -------------------------------------------------

    def blocking_fragments(self, now: float) -> list[int]:
        """Fragments the loop must wait for before the next step (empty for 'continue').

        A lock-step learner waits at step send+tau until the fragment arrives, or gives up
        after ``syncer_timeout_s`` and trains on (its counters keep growing).
        """
        if self.cfg.late_fragment != "wait":
            return []
        waiting = []
        for p, sent in list(self.in_flight.items()):
            if self.step < sent + self.cfg.overlap:
                continue
            since = self.blocked_since.setdefault(p, now)
            if now - since >= self.cfg.syncer_timeout_s:
                del self.in_flight[p]
                del self.blocked_since[p]
                continue
            waiting.append(p)
        return waiting

    def block_deadline(self) -> float | None:
        """When the current wait gives up (None when not blocked)."""
        if not self.blocked_since:
            return None
        return min(self.blocked_since.values()) + self.cfg.syncer_timeout_s
