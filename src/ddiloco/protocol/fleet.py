"""What the learners report of their progress: the fleet view's figures, and the fleet's
processed tokens that the run's budget counts.

Heartbeats carry counters that are cumulative over one incarnation (one process start): steps,
tokens, busy seconds, contribution bytes, the last loss. The algorithm never reads them; they
feed ``ddiloco status``, metrics/learners.jsonl and the processed-token budget. The tokens of
every incarnation are kept (``core.counters.IncarnationCounters``), so a learner that restarts
does not take back the tokens its earlier processes processed, and a restarted syncer can take
the totals back from its durable state.

A heartbeat's tokens are a claim, and one claim must not end or skew the run (the budget, the
inner LR schedule's position and goodput all come from this count). So a learner's tokens are
believed only as fast as the syncer can vouch for, by a token bucket per learner: it fills at
the rate cap for the wall time the syncer saw pass since the learner's first registration (a
new incarnation does not refill it), up to one liveness window's worth (a held link delivers a
window of heartbeats at once), and each heartbeat's growth is believed up to what it holds.
The cap is ``token_rate_spread`` times the (upper) median training rate the *other* live
learners claim (a minority cannot move it; each one's rate is over the span of its own claims,
so joining takes no part); ``lone_tokens_per_s`` for a learner alone; and 0 while the others
are live but none has claimed growth yet (the run's first heartbeats: its claims wait for
theirs, then count, cumulatively). What a
heartbeat claims beyond that is refused (``refused_tokens``, one "implausible" note each); its
next heartbeat, cumulative, claims it again, so a learner refused by a cap that was too low
counts it later.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from ddiloco.core.counters import IncarnationCounters
from ddiloco.core.messages import MAX_TOKENS_F, Heartbeat

RATES_REFRESH_S = 0.25
"""How stale the sorted rates of the fleet may be (seconds of the syncer's clock)."""


@dataclass
class Progress:
    """One learner's last reported progress (its current incarnation's counters)."""

    incarnation: int
    """The incarnation that reported it."""
    step: int = 0
    """Its inner steps."""
    tokens: int = 0
    """Tokens it processed, as far as believed (its claims, within the rate cap)."""
    busy_s: float = 0.0
    """Seconds it spent in inner steps."""
    loss: float | None = None
    """Its last training loss (None: none reported)."""
    bytes_sent: int = 0
    """Contribution bytes it sent."""
    claimed: int = 0
    """Tokens it claims to have processed (its last heartbeat's count)."""
    first: tuple[float, int] | None = None
    """(the syncer's time, its claim) of its first claim of tokens: its training rate is over
    the span of its claims since (None: none yet)."""
    heard: float = 0.0
    """The syncer's time of its last heartbeat (or registration)."""
    credit: float = 0.0
    """Tokens its next heartbeat may still grow by (the bucket: it fills from its registration,
    and a new incarnation of the learner goes on with its predecessor's, so registering again
    does not refill it)."""
    filled: float = 0.0
    """The syncer's time up to which the bucket has been filled (it stands still while the cap
    is 0: that time fills it at the cap that follows)."""

    @property
    def deferred(self) -> bool:
        """Its last heartbeat came while its cap was 0 (the bucket's fill stood still since):
        the time since ``filled`` counts in full at the next cap, not only one window of it
        (what it trained while it waited for the others' rates is not lost)."""
        return self.filled < self.heard

    def rate(self) -> float | None:
        """Tokens a second it claims to train at, over the span of its claims (None: no growth
        claimed over a span yet)."""
        if self.first is None or self.heard <= self.first[0] or self.claimed <= self.first[1]:
            return None
        return (self.claimed - self.first[1]) / (self.heard - self.first[0])


class FleetBook:
    """Every learner's last reported progress, and the tokens of all their incarnations."""

    def __init__(self, token_rate_spread: float = 4.0, lone_tokens_per_s: float = 1e6, window_s: float = 10.0) -> None:
        self.progress: dict[int, Progress] = {}
        self._tokens = IncarnationCounters()
        self.spread, self.lone_rate, self.window_s = token_rate_spread, lone_tokens_per_s, window_s
        self._rates_at: float | None = None
        self._rate_of: dict[int, float] = {}
        self._live: set[int] = set()
        self._sorted: list[float] = []
        self.refused_tokens = 0.0
        """Tokens claimed beyond the bucket when they were claimed (a claim repeated by later
        heartbeats is counted again each time it is refused)."""

    def rate_cap(self, learner: int, live: Callable[[], Collection[int]], now: float) -> float:
        """Tokens a second ``learner``'s heartbeats are believed up to: the spread times the
        (upper) median training rate the other live learners claim, of those that claim one (a
        stalled learner does not pull it to 0), or the lone rate while none does. ``live`` gives
        the live learners' ids; the rates are sorted at most every ``RATES_REFRESH_S``, so a
        heartbeat costs a bisection, not a pass over the fleet."""
        if self._rates_at is None or not 0 <= now - self._rates_at < RATES_REFRESH_S:
            self._live = set(live())
            self._rate_of = {m: r for m, p in self.progress.items() if m in self._live and (r := p.rate()) is not None}
            self._sorted = sorted(self._rate_of.values())
            self._rates_at = now
        rates, own = self._sorted, self._rate_of.get(learner)
        n = len(rates) - (own is not None)  # the others
        if n == 0:
            # Alone: the lone rate. Beside live learners that have not claimed a rate yet (the
            # run's first heartbeats): nothing yet, or one insider's first claim would be believed
            # at the lone rate and end a short run; its claims, cumulative, count once theirs do.
            return self.lone_rate if not self._live - {learner} else 0.0
        k = n // 2  # the upper median of the others: rates without one copy of its own
        if own is not None and k >= bisect.bisect_left(rates, own):
            k += 1
        return self.spread * rates[k]

    def heartbeat(self, hb: Heartbeat, now: float, cap_per_s: float = math.inf) -> float:
        """A heartbeat of the learner's registered incarnation (the caller checked it), its
        tokens believed within the learner's bucket at ``cap_per_s``. Returns the tokens refused."""
        loss = hb.loss if hb.loss >= 0 else None
        old = self.progress.get(hb.learner)
        if old is None or old.incarnation != hb.incarnation:  # not seen registering (a restarted syncer)
            old = self._fresh(hb.learner, hb.incarnation, now)
        grown = max(0, hb.tokens - old.tokens)
        filled = now if cap_per_s > 0 else old.filled
        if cap_per_s == math.inf:
            credit, allowed = math.inf, grown
        else:
            span = max(0.0, now - old.filled)
            depth = max(self.window_s, span) if old.deferred else self.window_s
            credit = min(cap_per_s * depth, old.credit + cap_per_s * span)
            allowed = min(grown, int(credit))
        first = old.first if old.first is not None or hb.tokens <= 0 else (now, hb.tokens)
        self.progress[hb.learner] = Progress(
            hb.incarnation, hb.step, old.tokens + allowed, hb.busy_s, loss, hb.bytes_sent, hb.tokens, first, now,
            credit - allowed, filled,
        )  # fmt: skip
        self._tokens.add(hb.learner, hb.incarnation, old.tokens + allowed, now)
        if cap_per_s == 0:  # deferred, not refused: the others have no rate to vouch by yet
            return 0.0
        self.refused_tokens += grown - allowed
        return float(grown - allowed)

    def restarted(self, learner: int, incarnation: int, now: float = 0.0) -> None:
        """A new incarnation registered: its counters start again from 0 (its predecessors'
        tokens stay counted)."""
        current = self.progress.get(learner)
        if current is None or current.incarnation != incarnation:
            self.progress[learner] = self._fresh(learner, incarnation, now)

    def _fresh(self, learner: int, incarnation: int, now: float) -> Progress:
        """An incarnation heard of from ``now``, believed as far as the tokens already counted
        for it (a restarted syncer took them back from its store; a new process has none), its
        bucket the learner's so far (a first one's fills from ``now``)."""
        tokens = int(self._tokens.best(learner, incarnation))
        old = self.progress.get(learner)
        if old is None:
            return Progress(incarnation, tokens=tokens, heard=now, filled=now)
        return Progress(
            incarnation, tokens=tokens, heard=min(old.heard, now), credit=old.credit, filled=min(old.filled, now)
        )

    def audit(self, age_s: float) -> list[tuple[int, float, float]]:
        """Lower every learner's count over the run to what the syncer can vouch for once the
        heartbeats are gone (a restart on a run that ended: its store's counts may hold a claim
        no bucket checked, from an older syncer): ``spread`` times the upper median of the other
        learners' counts (of those with any), or for a learner alone the lone rate times the
        run's age ``age_s``. The cost: an honest learner that trained on long while the others
        were down is cut too, and a finished run restarted goes on for what was cut. Returns
        (learner, counted before, counted now) for each one lowered."""
        totals = self._tokens.per_learner()
        lowered = []
        for m, count in totals.items():
            others = sorted(v for k, v in totals.items() if k != m and v > 0)
            bound = self.spread * others[len(others) // 2] if others else self.lone_rate * max(0.0, age_s)
            if count > bound:
                self._tokens.clip(m, bound)
                lowered.append((m, count, bound))
        return lowered

    def processed_tokens(self) -> float:
        """Tokens the fleet processed, over every learner and incarnation (as reported)."""
        return self._tokens.total()

    def tokens_per_step(self) -> float:
        """The tokens one learner processes per inner step: the lower median over the learners'
        current incarnations of each one's claimed tokens over its reported steps (one insider of
        three or more cannot move it; 0.0 before any step is reported; at most ``MAX_TOKENS_F``).
        Claims, not the counts believed: those lag while the bucket waits for the others' rates."""
        per = sorted(p.claimed / p.step for p in self.progress.values() if p.step > 0 and p.claimed > 0)
        return min(MAX_TOKENS_F, per[(len(per) - 1) // 2]) if per else 0.0

    def state(self) -> dict[str, Any]:
        """What a restart needs to keep counting (JSON-able)."""
        return self._tokens.state()

    def load_state(self, state: Any) -> None:
        """Take back ``state`` (malformed entries are ignored: it comes from a file)."""
        self._tokens.load_state(state)
