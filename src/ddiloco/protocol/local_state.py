"""What a learner process keeps of its protocol state for the next process of the same learner
on the same machine, and how that process takes it back (pure: values in, values out).

A restarted learner that has its predecessor's saved state (``runtime.local_state_s``) holds a
version of every fragment already: its model, its optimizer, and here, the versions it holds,
each fragment's progress since, its base copies (what its deltas are measured against, and what
the syncer's down-link chain served it) and its error-feedback residuals. It registers claiming
those versions, in the run it saved them in; the syncer sends only what moved since (the
chain's encoded changes, or the fragment in full), and nobody hands it an optimizer state.

The driver writes and reads the files (``service/learner/local_state.py``); the model's and the
optimizer's values are the driver's too. Everything read back is checked here against the
session's layout before any of it is taken.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ddiloco.core.validation import check_update
from ddiloco.protocol.learner_session import LearnerSession

MAX_COUNT = 2**53
"""Largest step or token count taken back (a float64 still counts it exactly)."""


@dataclass(frozen=True)
class LocalState:
    """A learner session's state worth keeping across its process (one entry per fragment)."""

    versions: tuple[int, ...]
    """The version of each fragment the learner holds."""
    steps: tuple[int, ...]
    """Inner steps since that version, per fragment (its next contribution's ``steps``)."""
    tokens: tuple[int, ...]
    """Tokens since that version, per fragment."""
    step: int
    """Inner steps of the learner (its core's step count)."""
    merged_tokens: float
    """The syncer's merged-token count as last heard (the LR schedule's position)."""
    fleet: int
    """The live learners as last heard."""
    runs: tuple[str, ...]
    """Each shard's run identity (``JoinReply.run``; empty: not said)."""
    base: dict[int, list[torch.Tensor]]
    """Fragment -> its values at ``versions[p]`` as the learner holds them (its base copy)."""
    residual: dict[int, list[torch.Tensor]]
    """Fragment -> what its last lossy encoding dropped (error feedback; empty pieces for
    buffers), for the fragments that have one."""


def capture(session: LearnerSession) -> LocalState:
    """The session's state now. Tensors are the session's own (base copies and residuals are
    replaced, never written in place, so a writer may read them later); counters are copied."""
    core, codec = session.core, session.codec
    return LocalState(
        versions=tuple(core.base_version),
        steps=tuple(core.steps),
        tokens=tuple(core.tokens),
        step=core.step,
        merged_tokens=core.merged_tokens,
        fleet=core.fleet,
        runs=tuple(link.run for link in session.links),
        base={p: vals for p, (_, vals) in codec.base.items()},
        residual=dict(codec.residual),
    )


def check(session: LearnerSession, state: LocalState) -> str | None:
    """Why ``state`` cannot be taken back by ``session`` (None: it can): one entry per fragment
    of this layout and per shard, counts that are whole and in range, a base copy of every
    fragment that fits its pieces and is finite, residuals that fit their pieces."""
    n = session.layout.num_fragments
    if not len(state.versions) == len(state.steps) == len(state.tokens) == n:
        return f"it has {len(state.versions)} fragments' counters, this layout {n}"
    if len(state.runs) != len(session.links):
        return f"it was saved against {len(state.runs)} syncer shards, this learner has {len(session.links)}"
    counts = [*state.versions, *state.steps, *state.tokens, state.step, state.fleet]
    if any(type(c) is not int or not 0 <= c <= MAX_COUNT for c in counts):
        return "a version, step or token count is not a whole number in [0, 2^53]"
    if not (math.isfinite(state.merged_tokens) and 0 <= state.merged_tokens <= session.core.max_merged_tokens):
        return f"its merged-token count {state.merged_tokens!r} is not plausible"
    pieces = session.layout.fragments
    if set(state.base) != set(range(n)):
        return f"it holds base copies of {len(state.base)} fragments, not of all {n}"
    for p, vals in state.base.items():
        problem = check_update(vals, pieces[p])
        if problem is not None:
            return f"fragment {p}'s base copy: {problem}"
    for p, res in state.residual.items():
        if p not in state.base or len(res) != len(pieces[p]):
            return f"fragment {p}'s residual does not fit the layout"
        for r, pc in zip(res, pieces[p]):
            want = tuple(pc.shape) if pc.kind == "param" else (0,)
            if tuple(r.shape) != want or r.dtype != torch.float32 or not bool(torch.isfinite(r).all()):
                return f"fragment {p}'s residual piece {pc.name} is not {want} finite float32 values"
    return None


def restore(session: LearnerSession, state: LocalState) -> str | None:
    """Take ``state`` back into a session that has not registered yet; the reason it is refused
    (the session then stays as it was: a fresh learner). Taken, the session holds every
    fragment (it trains once a shard accepts it), registers claiming its versions in their
    run, and asks no peer for an optimizer state."""
    problem = "the learner has registered already" if session.joined_once else check(session, state)
    if problem is not None:
        return problem
    session.core.restore(list(state.versions), list(state.steps), list(state.tokens), state.step,
                         state.merged_tokens, state.fleet)  # fmt: skip
    session.codec.base = {p: (state.versions[p], [v.float() for v in vals]) for p, vals in state.base.items()}
    session.codec.residual = {p: list(r) for p, r in state.residual.items()}
    session.received = set(range(session.layout.num_fragments))
    session.restored_runs = list(state.runs)
    session.wants_peer_state = False
    return None
