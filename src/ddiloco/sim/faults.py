"""Faults placed exactly, for the deterministic fault harness (``Simulation(..., faults=...)``).

The chaos schedule (``ddiloco.chaos``) draws failures at random times; these are placed by hand
at a chosen step, round or time, so a test can put a fault exactly where a rule is at stake (a
syncer restart inside a grace window, a learner killed just after it answered) and replay it
bit for bit. Times are virtual seconds since the run started.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddiloco.protocol.handoff import is_piece


@dataclass(frozen=True)
class KillLearner:
    """Kill a learner's process (no goodbye) when it finishes inner step ``at_step``; a new
    process starts ``restart_after_s`` later and registers again (never, if None)."""

    learner: int
    """Which learner."""
    at_step: int
    """The inner step of its running process after which it dies (once)."""
    restart_after_s: float | None = 5.0
    """Seconds until the new process starts (its start-up and join then take their own time)."""


@dataclass(frozen=True)
class RestartSyncer:
    """Kill a syncer shard once it has closed ``after_rounds`` rounds (or at ``at_s``); it comes
    back ``down_s`` later from what its store made durable, with a new epoch."""

    shard: int = 0
    """Which shard."""
    after_rounds: int | None = None
    """Kill it right after the round that brings its closed rounds to this many."""
    at_s: float | None = None
    """Or kill it at this time."""
    down_s: float = 3.0
    """How long it stays down."""


@dataclass(frozen=True)
class Partition:
    """Cut a learner off from every syncer shard for ``duration_s`` from ``start_s``: messages
    either way are lost (as on a reset connection); both sides keep running."""

    learner: int
    """Which learner."""
    start_s: float
    """When the partition starts."""
    duration_s: float
    """How long it lasts."""


@dataclass(frozen=True)
class Slow:
    """Make a learner's steps ``factor`` times longer from ``start_s`` to ``end_s``."""

    learner: int
    """Which learner."""
    factor: float
    """Step-time multiplier (> 1: slower)."""
    start_s: float = 0.0
    """When it starts."""
    end_s: float = float("inf")
    """When it ends."""


@dataclass(frozen=True)
class SlowLink:
    """Add ``extra_s`` of one-way latency to every message between a learner and the syncer
    shards, from ``start_s`` to ``end_s`` (a far site: its answers come after the others')."""

    learner: int
    """Which learner."""
    extra_s: float
    """Extra seconds each way."""
    start_s: float = 0.0
    """When it starts."""
    end_s: float = float("inf")
    """When it ends."""


@dataclass(frozen=True)
class Inject:
    """An insider: ``count`` copies of ``msg`` arrive at shard ``shard`` at ``at_s`` from
    learner ``learner``'s peer, as if that learner's process (its key, its connection) sent them:
    the attacker's side of a protocol rule (a flood of requests, a state nobody asked for)."""

    learner: int
    """Whose peer sends it (the syncer session sees that learner's bound peer)."""
    msg: Any
    """The message (``core.messages`` or ``protocol.messages``)."""
    at_s: float
    """When it arrives."""
    count: int = 1
    """How many copies arrive at that instant."""
    shard: int = 0
    """Which syncer shard receives it."""


@dataclass(frozen=True)
class HostilePeerState:
    """Learner ``learner`` serves a poisoned optimizer state whenever it is asked for its own:
    ``kind`` "nan" (every moment NaN), "weight_decay" (its param_groups ask for a weight decay
    of 1e6), "huge" (first moments 1e30, second moments 0) or "shape" (one moment misshapen)."""

    learner: int
    """The hostile learner."""
    kind: str = "nan"
    """What it poisons."""


def poisoned_state(ps: Any, kind: str) -> Any:
    """``ps`` (a ``PeerState``) as a ``HostilePeerState`` of ``kind`` serves it."""
    import dataclasses
    import math

    tensors = dict(ps.tensors)
    groups = [dict(g) for g in ps.param_groups]
    if kind == "nan":
        tensors = {k: t.clone().fill_(math.nan) if not k.endswith(".step") else t for k, t in tensors.items()}
    elif kind == "weight_decay" and not is_piece(ps):  # (a piece's groups only mark it: more follow)
        groups = [{**g, "weight_decay": 1e6, "lr": 1e3} for g in groups]
    elif kind == "huge":
        tensors = {
            k: t.clone().fill_(1e30 if k.endswith("exp_avg") else 0.0) if not k.endswith(".step") else t
            for k, t in tensors.items()
        }
    elif kind == "shape":
        first = next(k for k in tensors if not k.endswith(".step"))
        tensors[first] = tensors[first].reshape(-1)[:1].clone()
    return dataclasses.replace(ps, param_groups=groups, tensors=tensors)


class PoisonedServer:
    """A ``training.peer_state.StateServer`` whose every piece ``poisoned_state`` poisons (the
    hostile learner serves the same way an honest one does, ``protocol/boundary.py``)."""

    def __init__(self, server: Any, kind: str) -> None:
        self.server, self.kind = server, kind

    @property
    def done(self) -> bool:
        return bool(self.server.done)

    @property
    def copy_s(self) -> float:
        return float(self.server.copy_s)

    def piece(self, budget_bytes: int) -> Any:
        ps = self.server.piece(budget_bytes)
        return None if ps is None else poisoned_state(ps, self.kind)


Fault = KillLearner | RestartSyncer | Partition | Slow | SlowLink | Inject | HostilePeerState
"""Any fault the harness can place."""
