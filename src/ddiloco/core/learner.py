"""A learner's side of the protocol as a state machine (no model, no clock, no I/O).

It keeps per-fragment counters and base versions, builds every contribution (numbered, with
the learner's identity), says which fragments will be asked for next, how to apply a received
one, and (for the lock-step baselines) when the training loop must wait. The driver owns the
model and the optimizer and acts on these decisions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import Piece, fragment_offset, next_due
from ddiloco.core.messages import Contribution, FragmentUpdate, PayloadKind
from ddiloco.core.validation import check_update

ApplyMode = Literal["overwrite", "blend", "shift", "ignore"]
MAX_EXPERT_ROWS = 4096
"""Most rows (experts) of a tensor that routed-token counts may describe (they travel in the
JSON header with every answer of its fragment)."""
ROUTED_SNAPSHOTS = 4
"""Routed-count totals kept per fragment for contributions built but not sent yet."""


def routed_counts(
    routed: Mapping[str, object], rows: Mapping[str, int], tokens: int, scale: int = 1
) -> dict[str, torch.Tensor]:
    """A training loop's routed-token counts (``step(routed=...)``) checked and made int64 on
    the CPU, times ``scale`` (a torchrun group's world size, as its tokens are): for each
    expert-stacked parameter named in ``rows`` (its rows along dim 0), one count per row, each
    an integer in [0, tokens] (a token reaches an expert at most once). Raises ValueError with
    one line naming what is wrong."""
    out = {}
    for name, counts in routed.items():
        if name not in rows:
            raise ValueError(f"routed counts for {name!r}: not a parameter of the model's layout")
        if rows[name] > MAX_EXPERT_ROWS:
            raise ValueError(f"routed counts for {name!r}: {rows[name]} rows, at most {MAX_EXPERT_ROWS} experts")
        if isinstance(counts, torch.Tensor):
            t = counts.detach().to("cpu").reshape(-1)
            if t.is_floating_point() or t.dtype == torch.bool:
                raise ValueError(f"routed counts for {name!r} are {t.dtype}: pass integers (a bincount)")
            t = t.to(torch.int64)
        else:
            try:
                values = list(counts)  # type: ignore[call-overload]
            except TypeError:
                raise ValueError(f"routed counts for {name!r} must be a tensor or a list of integers") from None
            if not all(type(v) is int for v in values):
                raise ValueError(f"routed counts for {name!r} must be integers")
            t = torch.tensor(values, dtype=torch.int64)
        if t.numel() != rows[name]:
            raise ValueError(f"routed counts for {name!r}: {t.numel()} values, its dim 0 has {rows[name]} rows")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) > tokens):
            raise ValueError(
                f"routed counts for {name!r} must lie in [0, tokens={tokens}] (a token counts once per expert), "
                f"got [{int(t.min())}, {int(t.max())}]"
            )
        out[name] = t * scale
    return out


@dataclass(frozen=True)
class Receipt:
    """What to do with a received fragment: write ``alpha*local + (1-alpha)*global`` (overwrite
    is alpha = 0), move the local values by the merged change (shift: ``algo.on_merged``), or
    ignore it."""

    mode: ApplyMode
    alpha: float = 0.0
    problem: str = ""
    """Why it is ignored when it is not plausible (empty for an ordinary older version)."""
    own: bool = False
    """A merged version that answers a contribution this process sent (not a predecessor's):
    the driver's ``first_merged`` start-up mark."""


class LearnerCore:
    """Counters, contributions, request forecast, apply policy and blocking of one learner."""

    def __init__(
        self,
        cfg: DiLoCoConfig,
        learner: int,
        num_fragments: int,
        incarnation: int = 0,
        max_merged_tokens: float = math.inf,
    ) -> None:
        self.cfg = cfg
        self.max_merged_tokens = max_merged_tokens
        self.learner = learner
        self.incarnation = incarnation
        self.num_fragments = num_fragments
        self.step = 0
        self.steps = [0] * num_fragments
        self.tokens = [0] * num_fragments
        self.base_version = [0] * num_fragments
        self.tokens_processed = 0
        self.seq = 0
        # Fragments the syncer is expected to ask for next (learned from its requests).
        self.expected: list[int] = []
        # Lock-step ('wait') learners: fragment -> step it was sent at, until it comes back.
        self.in_flight: dict[int, int] = {}
        self.blocked_since: dict[int, float] = {}
        # Inner LR schedule position, extrapolated from the syncer's global token count.
        self._merged_tokens = 0.0
        self._fleet = 1
        # Fragment -> its token count when last contributed (the ranks of a DDP learner copy
        # rank 0's before applying fragments, since only rank 0 contributes).
        self.sent_tokens: dict[int, int] = {}
        self.sent_steps: dict[int, int] = {}
        self._overwritten = 0  # tokens trained after a contribution and overwritten by its merge
        self.kept_tokens = 0
        """Tokens trained after a contribution that a shift kept (``algo.on_merged``): they go
        into the fragment's next contribution instead of being overwritten."""
        # Routed-token counts (``algo.expert_weights = "routed"``): per expert-stacked parameter,
        # the tokens routed to each row over this incarnation. A fragment's counts are these
        # minus its mark (the totals when it last took a version), as its tokens are.
        self.routed: dict[str, torch.Tensor] = {}
        self._routed_mark: list[dict[str, torch.Tensor]] = [{} for _ in range(num_fragments)]
        self._routed_built: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # p -> seq -> totals then
        self._routed_sent: dict[int, dict[str, torch.Tensor]] = {}  # p -> totals when its answer was built

    # -- training progress ------------------------------------------------------------------

    def on_step(self, tokens: int, routed: Mapping[str, torch.Tensor] | None = None) -> list[int]:
        """Count one finished inner step (``routed``: the tokens it routed to each row of each
        expert-stacked parameter, int64 on the CPU, already checked by the driver; counted only
        with ``algo.expert_weights = "routed"``); return fragments a lock-step learner sends now."""
        self.step += 1
        self.tokens_processed += tokens
        if routed and self.cfg.expert_weights == "routed":
            for name, counts in routed.items():
                total = self.routed.get(name)
                if total is None or total.shape != counts.shape:
                    self.routed[name] = counts.clone()
                else:
                    total += counts
        for p in range(self.num_fragments):
            self.steps[p] += 1
            self.tokens[p] += tokens
        if self.cfg.late_fragment != "wait":
            return []
        return [p for p in range(self.num_fragments) if self._due(p)]

    def _due(self, p: int) -> bool:
        phase = self.step % self.cfg.sync_every
        return phase == fragment_offset(p, self.num_fragments, self.cfg.sync_every) and p not in self.in_flight

    def contribution(
        self,
        p: int,
        values: list[torch.Tensor],
        data_position: int,
        kind: PayloadKind = "values",
        pieces: Sequence[Piece] = (),
    ) -> Contribution:
        """Fragment p's contribution now, from ``values`` taken at this step boundary (numbered:
        every contribution built has a new ``seq``), with the routed-token counts of its
        ``pieces`` when there are any. Call ``sent`` when it is sent."""
        self.seq += 1
        routed = self._routed_counts(p, pieces) if self.routed and pieces else []
        if routed:  # a prepared snapshot may be sent a few boundaries later: keep the last few
            built = self._routed_built.setdefault(p, {})
            built[self.seq] = {n: t.clone() for n, t in self.routed.items()}
            for old in sorted(built)[:-ROUTED_SNAPSHOTS]:
                del built[old]
        return Contribution(
            learner=self.learner,
            incarnation=self.incarnation,
            fragment=p,
            base_version=self.base_version[p],
            seq=self.seq,
            values=values,
            steps=self.steps[p],
            tokens=self.tokens[p],
            data_position=data_position,
            step=self.step,
            kind=kind,
            routed=routed,
        )

    def _routed_counts(self, p: int, pieces: Sequence[Piece]) -> list[list[int]]:
        """Per piece of fragment p, the tokens routed to each row of its whole tensor since p's
        mark (empty for a piece without counts; empty altogether if no piece has any). Each is
        clamped to [0, tokens], the bound the syncer checks (a restart can exceed it)."""
        mark, most = self._routed_mark[p], self.tokens[p]
        out: list[list[int]] = []
        for pc in pieces:
            total = self.routed.get(pc.name) if pc.kind == "param" else None
            if total is None or total.dim() != 1 or total.numel() < pc.row_end:
                out.append([])
                continue
            since = total - mark[pc.name] if pc.name in mark and mark[pc.name].shape == total.shape else total
            out.append([min(max(int(r), 0), most) for r in since.tolist()])
        return out if any(out) else []

    def sent(self, c: Contribution) -> None:
        """``c`` was sent: a lock-step learner waits for its fragment, and the tokens it carried
        are what a merge of it will overwrite (a snapshot built but never sent is neither)."""
        if self.cfg.late_fragment == "wait":
            self.in_flight[c.fragment] = c.step
        self.sent_tokens[c.fragment] = c.tokens
        self.sent_steps[c.fragment] = c.steps
        totals = self._routed_built.pop(c.fragment, {}).get(c.seq)
        if totals is not None:
            self._routed_sent[c.fragment] = totals

    def on_request(self, p: int) -> None:
        """The syncer asked for p: the schedule says which fragments it will ask for next."""
        per_tick = math.ceil(self.num_fragments / self.cfg.sync_every)
        self.expected = next_due(p, self.num_fragments, self.cfg.sync_every, per_tick + 1)

    def fleet_tokens(self) -> float:
        """The tokens the whole fleet has processed, as this learner estimates them (the inner LR
        schedule's position): the syncer's merged count plus the fleet's progress not merged
        yet, estimated from this learner's own unmerged tokens (its mean over fragments, times
        the fleet size it was told).

        The merged count is a mean over fragments, and fragments merge in turn, so it trails
        the fleet by about H/2 steps; each fragment's unmerged tokens make up exactly that. The
        steps a learner trains between sending a fragment and receiving its merge are overwritten
        and never merged (up to tau of every H steps): they were processed all the same, so they
        count too, or the schedule would fall behind by that share over the run. (A restarted
        process knows only its own: its position trails by that share of the time before it.)
        """
        unmerged = (sum(self.tokens) + self._overwritten) / max(1, self.num_fragments)
        return self._merged_tokens + self._fleet * unmerged

    @property
    def merged_tokens(self) -> float:
        """The syncer's merged-token count as last heard."""
        return self._merged_tokens

    @property
    def fleet(self) -> int:
        """The live learners as last heard."""
        return self._fleet

    def restore(
        self, versions: list[int], steps: list[int], tokens: list[int], step: int, merged_tokens: float, fleet: int
    ) -> None:
        """Take back a predecessor's saved counters (``protocol/local_state.py`` checked them):
        the versions it held and each fragment's progress since, its step count and where it
        had heard the fleet was. What this process sends is counted anew (tokens processed)."""
        self.base_version, self.steps, self.tokens = list(versions), list(steps), list(tokens)
        self.step = step
        self._merged_tokens, self._fleet = merged_tokens, max(1, fleet)

    # -- receiving ---------------------------------------------------------------------------

    def on_update(self, u: FragmentUpdate, pieces: Sequence[Piece] | None = None) -> Receipt:
        """Accept a global fragment, or ignore it.

        Versions never go backwards: an update older than the learner's base is ignored. A
        fetch on join, or a rebase after a stale answer, always overwrites. What is not
        plausible is ignored with the reason: values that do not fit ``pieces`` or are not
        finite, a merge more versions ahead than a merge can be, a global token count beyond
        ``max_merged_tokens``.
        """
        p = u.fragment
        if not 0 <= p < self.num_fragments:
            return Receipt("ignore", problem=f"fragment {p} is not in the layout ({self.num_fragments})")
        if u.version < self.base_version[p]:
            return Receipt("ignore")
        # A merge answers a contribution anchored at a kept version: it cannot be further ahead.
        if u.reason == "merged" and u.version > self.base_version[p] + self.cfg.keep_versions + 1:
            return Receipt(
                "ignore", problem=f"merged version {u.version} is implausibly far past {self.base_version[p]}"
            )
        if not u.merged_tokens <= self.max_merged_tokens:
            return Receipt("ignore", problem=f"merged_tokens {u.merged_tokens:.3g} > {self.max_merged_tokens:.3g}")
        problem = check_update(u.values, pieces) if pieces is not None else None
        if problem is not None:
            return Receipt("ignore", problem=problem)
        sent = self.sent_tokens.pop(p, None)
        sent_steps = self.sent_steps.pop(p, 0)
        routed_sent = self._routed_sent.pop(p, None)
        shift = u.reason == "merged" and self.cfg.on_merged != "overwrite"
        if shift:
            # The local progress stays in the fragment and goes into its next contribution: the
            # steps since the last one was sent (all of them if none was: they stay counted).
            if sent is not None:
                self.tokens[p] = max(0, self.tokens[p] - sent)
                self.steps[p] = max(0, self.steps[p] - sent_steps)
                self.kept_tokens += self.tokens[p]
                if routed_sent is not None:  # the counts since the answer stay too
                    self._routed_mark[p] = routed_sent
        else:
            if u.reason == "merged" and sent is not None:
                self._overwritten += max(0, self.tokens[p] - sent)
            self.steps[p] = 0
            self.tokens[p] = 0
            if self.routed:
                self._routed_mark[p] = {n: t.clone() for n, t in self.routed.items()}
        self.base_version[p] = u.version
        self.in_flight.pop(p, None)
        self.blocked_since.pop(p, None)
        self._merged_tokens = max(self._merged_tokens, u.merged_tokens)
        self._fleet = u.live_learners
        if u.reason == "join" and self.cfg.late_fragment == "wait" and self.step == 0:
            self.step = u.global_step  # a (re)started lock-step learner steps in phase with the fleet
        own = u.reason == "merged" and sent is not None
        if shift:
            return Receipt("shift", own=own)
        if u.reason != "merged" or self.cfg.alpha == 0.0:
            return Receipt("overwrite", own=own)
        return Receipt("blend", self.cfg.alpha, own=own)

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
            if now >= since + self.cfg.syncer_timeout_s:  # the same sum as block_deadline: no rounding gap
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
