"""The run's settings as the protocol sees them: plain ``"section.key" -> value`` dicts.

Which settings there are, and how a ``Config`` becomes one and back, is ``ddiloco.settings``'
business (``protocol`` does not know ``Config``). Here are the two rules the sessions apply:

- ``first_difference``: a learner that claims settings (it was given a config) is refused at
  registration when one differs from the run's, naming the first in the syncer's order;
- ``SettingsQuery``: a learner given no config asks syncer shard 0 for the run's settings
  before it registers (its fragment layout depends on them), with backoff, and takes the
  answer (``RunSettings``), a refusal (``JoinReply``: an id outside the cap, a wrong key) or the
  news that the run is over (``RunEnd``).

Pure, like the sessions: the time goes in, messages come out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ddiloco.protocol.config import RuntimeConfig
from ddiloco.protocol.learner_session import LearnerOutput, Send
from ddiloco.protocol.messages import JoinReply, RunEnd, RunSettings, SettingsRequest, SyncerHeartbeat

UNSAID_AT: dict[str, Any] = {"algo.up_density": 1.0, "algo.down_density": 1.0}
"""Settings newer than some peers of this wire schema, left out of the settings a syncer sends
and a learner claims while they hold the value those peers behave as: an older learner joins a
newer run that does not use them, and an older syncer takes a newer learner that does not
(one that does is refused: "unknown to the syncer")."""


def said(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` less those at their ``UNSAID_AT`` value."""
    return {k: v for k, v in settings.items() if k not in UNSAID_AT or v != UNSAID_AT[k]}


def first_difference(run: Mapping[str, Any], claimed: Mapping[str, Any]) -> str | None:
    """The first setting (in the run's order) on which ``claimed`` differs from ``run``, as
    ``"KEY is A on this learner and B on the syncer"``; a claimed key the run does not have is
    one too. None when every claimed setting agrees (unclaimed ones are not checked; an
    ``UNSAID_AT`` one left out is at that value)."""
    if claimed:  # a learner given a config: what either side leaves unsaid is at its old value
        run = {**{k: v for k, v in UNSAID_AT.items() if k not in run}, **run}
        claimed = {**{k: v for k, v in UNSAID_AT.items() if k not in claimed}, **claimed}
    for key, value in run.items():
        if key in claimed and claimed[key] != value:  # 24 == 24.0: TOML and JSON may type a number apart
            return f"{key} is {claimed[key]!r} on this learner and {value!r} on the syncer"
    for key, value in claimed.items():
        if key not in run:
            return f"{key} is {value!r} on this learner and unknown to the syncer (another ddiloco version?)"
    return None


def settings_refusal(difference: str) -> str:
    """The syncer's one-line reason for a learner whose claimed settings differ."""
    return (
        f"its settings differ from the run's: {difference}: give it the run's config (the syncer's "
        "config.toml), or none, to adopt the run's settings"
    )


class SettingsQuery:
    """A learner's question for the run's settings, before it registers (shard 0 answers)."""

    def __init__(self, learner: int, incarnation: int, rt: RuntimeConfig, now: float) -> None:
        self.learner, self.incarnation, self.rt = learner, incarnation, rt
        self.settings: dict[str, Any] | None = None
        """The run's settings, once shard 0 answered."""
        self.refused: str | None = None
        """Why shard 0 refused this learner for good (an id outside the cap, a key not its own)."""
        self.ended: str | None = None
        """Why the run ended, when shard 0 says it is over."""
        self.heard = False
        """Whether shard 0 answered anything (else: not reachable, or not taking this learner)."""
        self._next = now
        self._backoff = rt.backoff_initial_s

    @property
    def done(self) -> bool:
        return self.settings is not None or self.refused is not None or self.ended is not None

    def tick(self, now: float) -> LearnerOutput:
        """Ask (again, with backoff) until an answer comes."""
        out = LearnerOutput()
        if not self.done and now >= self._next:
            out.send.append(Send(0, SettingsRequest(self.learner, self.incarnation)))
            self._next = now + self._backoff
            self._backoff = min(self._backoff * 2, self.rt.backoff_max_s)
        return out

    def next_deadline(self, now: float) -> float | None:
        return None if self.done else max(self._next, now)

    def receive(self, shard: int, msg: Any, now: float) -> LearnerOutput:
        out = LearnerOutput()
        if shard != 0:
            return out  # only shard 0 is asked
        self.heard = True
        if isinstance(msg, RunSettings):
            if self.settings is None:
                self.settings = dict(msg.settings)
        elif isinstance(msg, JoinReply) and not msg.accepted:
            if msg.retry_after_s > 0:
                self._next = now + msg.retry_after_s
            else:
                self.refused = msg.reason
        elif isinstance(msg, RunEnd):
            self.ended = msg.reason
        elif not isinstance(msg, SyncerHeartbeat):
            out.notes.append(f"learner {self.learner}: unexpected {type(msg).__name__} before registering")
        if self.done:
            self._next = math.inf
        return out
