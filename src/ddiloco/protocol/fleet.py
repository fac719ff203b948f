"""What the learners report of their progress: the fleet view's figures, and the fleet's
processed tokens that the run's budget counts.

Heartbeats carry counters that are cumulative over one incarnation (one process start): steps,
tokens, busy seconds, contribution bytes, the last loss. The algorithm never reads them; they
feed ``ddiloco status``, metrics/learners.jsonl and the processed-token budget. The tokens of
every incarnation are kept (``core.counters.IncarnationCounters``), so a learner that restarts
does not take back the tokens its earlier processes processed, and a restarted syncer can take
the totals back from its durable state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddiloco.core.counters import IncarnationCounters
from ddiloco.core.messages import MAX_TOKENS_F, Heartbeat


@dataclass
class Progress:
    """One learner's last reported progress (its current incarnation's counters)."""

    incarnation: int
    """The incarnation that reported it."""
    step: int = 0
    """Its inner steps."""
    tokens: int = 0
    """Tokens it processed."""
    busy_s: float = 0.0
    """Seconds it spent in inner steps."""
    loss: float | None = None
    """Its last training loss (None: none reported)."""
    bytes_sent: int = 0
    """Contribution bytes it sent."""


class FleetBook:
    """Every learner's last reported progress, and the tokens of all their incarnations."""

    def __init__(self) -> None:
        self.progress: dict[int, Progress] = {}
        self._tokens = IncarnationCounters()

    def heartbeat(self, hb: Heartbeat, now: float) -> None:
        """A heartbeat of the learner's registered incarnation (the caller checked it)."""
        loss = hb.loss if hb.loss >= 0 else None
        self.progress[hb.learner] = Progress(hb.incarnation, hb.step, hb.tokens, hb.busy_s, loss, hb.bytes_sent)
        self._tokens.add(hb.learner, hb.incarnation, hb.tokens, now)

    def restarted(self, learner: int, incarnation: int) -> None:
        """A new incarnation registered: its counters start again from 0 (its predecessors'
        tokens stay counted)."""
        current = self.progress.get(learner)
        if current is None or current.incarnation != incarnation:
            self.progress[learner] = Progress(incarnation)

    def processed_tokens(self) -> float:
        """Tokens the fleet processed, over every learner and incarnation (as reported)."""
        return self._tokens.total()

    def tokens_per_step(self) -> float:
        """The tokens one learner processes per inner step: the reported tokens over the reported
        steps of every learner's current incarnation (0.0 before any step is reported; at most
        ``MAX_TOKENS_F``, whatever the heartbeats claim)."""
        steps = sum(p.step for p in self.progress.values())
        tokens = sum(p.tokens for p in self.progress.values())
        return min(MAX_TOKENS_F, tokens / steps) if steps > 0 else 0.0

    def state(self) -> dict[str, Any]:
        """What a restart needs to keep counting (JSON-able)."""
        return self._tokens.state()

    def load_state(self, state: Any) -> None:
        """Take back ``state`` (malformed entries are ignored: it comes from a file)."""
        self._tokens.load_state(state)
