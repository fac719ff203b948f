"""One fragment's round, a room of its own: the answers it holds, their running merge, when it
may close, the screening at its close, and what the close hands back.

The syncer opens a ``Round`` (lending it a merge buffer), runs each contribution through
``admission.ADMISSION`` and hands what passed to ``accept``, which weighs it (token weight,
the weight cap it is given) and feeds the running merge. At every poll the syncer asks
``close_reason`` with the live set, the fleet's step time and the sync-path time as values;
the round learns its quorum time and grace window from them. At the close, ``screen`` takes
answers out of line out of the merge (and, with the robust merge, weighs the rest by the trust
it is handed) and returns the refusals and the trust it judged; ``close`` returns the merged
outer gradient, the buffers' new values and the round's record. The room never touches a
fragment's versions, the outer optimizer, the learners' records or the tape: it returns what it
decided, and the syncer acts on it. It does not import the syncer.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ddiloco.core import robust
from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import Piece
from ddiloco.core.merge import Accumulator, RowAccumulator, row_factors, token_weight
from ddiloco.core.messages import Contribution
from ddiloco.core.tape import MAX_REJECTIONS_PER_ROUND, CloseReason, MergedEntry, Rejection, RejectReason, RoundRecord

SCREEN_ROUNDS = 3
"""Merged rounds (with steps) a fragment needs before its history is a screening reference."""

Refusal = tuple[Contribution, RejectReason, str]
"""An answer the round took out at its close: the contribution, why (a keyword), and a line."""


@dataclass
class Pending:
    """An accepted contribution waiting in a round. Its tensors now hold its outer gradient
    (computed in place on arrival): the only copy of it the syncer keeps."""

    contribution: Contribution
    deltas: list[torch.Tensor]
    norms: list[float]
    weight: float
    arrived_at: float
    clipped: bool = False
    scale: float = 1.0
    """Staleness discount of its outer gradient (1 unless ``staleness = "scaled"``)."""
    shrunk: float = 1.0
    """The robust merge's size clipping, already applied to ``deltas`` and ``norms``."""
    alignment: float = 1.0
    """The robust merge's alignment of it (1: not judged against a centre)."""
    drift: float = 0.0
    """Its learner's drift in this fragment after it (``robust.Drift``; 0: not judged)."""
    claimed: float = 0.0
    """Its weight as its counters claim it, after the fleet's weight cap, before the robust
    merge's judgement: what the weight cap's reference records (the judgement is not pace)."""
    factors: list[torch.Tensor | None] = field(default_factory=list)
    """Per piece, each row's share of ``weight`` from its routed-token counts (``row_factors``;
    None: no counts for the piece); empty when it sent none or they are not used."""


def tokens(pd: Pending) -> int:
    """The tokens a contribution brings to the global count: clipped with its weight
    (w = tokens^2/steps), so a clipped learner cannot inflate the count that drives every
    learner's LR schedule either."""
    c = pd.contribution
    return c.tokens if not pd.clipped else int(math.sqrt(pd.weight * c.steps))


def grace_window(cfg: DiLoCoConfig, t_step: float, t_sync: float, t_quorum: float) -> float:
    """grace = clamp(gamma*(tau*t_step - t_quorum - t_sync), 0, max_grace_steps*t_step)."""
    raw = cfg.grace_gamma * (cfg.overlap * t_step - t_quorum - t_sync)
    return min(max(raw, 0.0), cfg.max_grace_steps * t_step)


@dataclass
class Screened:
    """What the screening at a close decided: the answers it took out, and the trust it judged."""

    refused: list[Refusal] = field(default_factory=list)
    """In the order they were taken out (each is a strike for its sender)."""
    trust: dict[int, float] = field(default_factory=dict)
    """Per learner judged on a full-length answer, its trust after this round."""
    drift: dict[int, robust.Drift] = field(default_factory=dict)
    """Per learner judged on a full-length answer against a centre, its drift after this round."""


@dataclass
class Closed:
    """What a round's close hands the syncer."""

    record: RoundRecord
    """Its tape record (``version``: the fragment's version before the close; ``merged`` empty)."""
    pending: list[Pending]
    """Its answers, by learner."""
    merged: list[torch.Tensor] | None
    """The merged outer gradient, one tensor per piece, zeros for buffers (None: nothing merged)."""
    stats: dict[int, torch.Tensor]
    """The buffers' new values, by piece position (the answers' token-weighted mean)."""
    in_grace: set[int]
    """Learners admitted after the quorum."""

    def entries(self, version: int) -> list[MergedEntry]:
        """The tape's entry of every answer, once the fragment is at ``version``."""
        entries = []
        for pd in self.pending:
            c = pd.contribution
            staleness = version - 1 - c.base_version if version > c.base_version else 0
            entries.append(
                MergedEntry(
                    c.learner,
                    c.incarnation,
                    c.seq,
                    c.base_version,
                    staleness,
                    pd.weight,
                    tokens(pd),
                    c.steps,
                    c.learner in self.in_grace,
                    pd.clipped,
                    math.sqrt(sum(n * n for n in pd.norms)),
                    pd.shrunk,
                    pd.alignment,
                    pd.drift,
                )
            )
        return entries


def screened(norms: Sequence[float], steps: int) -> float:
    """The statistic the robust screening watches: |delta| per step. A learner that missed
    rounds (or trained on while the syncer was away) brings progress of many steps, which grows
    at most about linearly with them; the step count it may claim is bounded by the time since
    its base version (``max_speedup``)."""
    return math.sqrt(sum(n * n for n in norms)) / max(steps, 1)


def history_reference(recent: Sequence[float], merged_rounds: int, cfg: DiLoCoConfig) -> float | None:
    """The fragment's own reference |delta| per step: the 75th percentile of its recent merged
    answers, once it has SCREEN_ROUNDS merged rounds and ``norm_screen_min`` answers (None
    before: the first rounds of the LR warm-up move far less than later ones)."""
    ordered = sorted(recent)
    armed = merged_rounds >= SCREEN_ROUNDS and len(ordered) >= cfg.norm_screen_min
    return ordered[(3 * (len(ordered) - 1)) // 4] if armed else None


def out_of_line(
    stats: Mapping[int, float], recent: Sequence[float], merged_rounds: int, cfg: DiLoCoConfig
) -> list[tuple[int, float, float]]:
    """Robust screening, when a round closes: (learner, statistic, reference) of each answer
    whose |delta| per step (``stats``) exceeds norm_screen_factor x its reference. The
    reference is the larger of the fragment's history (the 75th percentile of its recent merged
    answers ``recent``, once it has SCREEN_ROUNDS merged rounds: the first rounds of the LR
    warm-up move far less than later ones) and the median of the other answers in this round
    (when there are at least two): a learner is compared with its peers, and a round in which
    everyone moves more than before is not an attack."""
    if cfg.norm_screen_factor <= 0:
        return []
    history = history_reference(recent, merged_rounds, cfg)
    found = []
    for m, x in stats.items():
        others = [y for o, y in stats.items() if o != m]
        peers = statistics.median(others) if len(others) >= 2 else None
        refs = [r for r in (history, peers) if r is not None]
        if refs and x > cfg.norm_screen_factor * max(refs):
            found.append((m, x, max(refs)))
    return found


def misaligned_detail(cosine: float, alignment: float, cfg: DiLoCoConfig) -> str:
    return (
        f"direction: cosine {cosine:.3g} with the round's centre is {alignment:.3g} x the round's median "
        f"cosine, below algo.robust_min_alignment = {cfg.robust_min_alignment:g}"
    )


def outlier_detail(x: float, ref: float, cfg: DiLoCoConfig) -> str:
    return (
        f"|delta| per step = {x:.3g} exceeds {cfg.norm_screen_factor:g} x its reference {ref:.3g} "
        "(the fragment's recent answers and this round's others)"
    )


@dataclass
class Round:
    """One open round of one fragment."""

    round_id: int
    fragment: int
    opened_at: float
    asked: set[int]
    cfg: DiLoCoConfig
    """The algorithm's settings."""
    pieces: Sequence[Piece]
    """The fragment's pieces."""
    buffers: Sequence[int]
    """Positions of its buffer pieces (merged as a weighted mean of values)."""
    pending: dict[int, Pending] = field(default_factory=dict)
    first_answer_at: float | None = None
    quorum_at: float | None = None
    grace_until: float | None = None
    grace_s: float = 0.0
    in_grace: set[int] = field(default_factory=set)
    rejected: list[Rejection] = field(default_factory=list)
    rejected_total: int = 0
    refused: set[int] = field(default_factory=set)
    """Learners whose answer in this round was refused (and not replaced by a good one)."""
    merge: list[Accumulator | RowAccumulator] = field(default_factory=list)
    """The running merge, one accumulator per piece, fed as contributions arrive."""
    per_row: list[bool] = field(default_factory=list)
    """Pieces merged row by row (``algo.expert_weights = "routed"``: every answer in the round
    carries routed-token counts for them)."""
    final: bool = False
    """A round of the run's final sync: it waits for every live learner it asked."""
    late: bool = False
    """A round opened by an answer that missed its own (staleness = "delayed"): it merges that
    answer alone, at once."""
    scratch: torch.Tensor | None = None
    """The flat buffer ``merge`` accumulates in, lent from the syncer's pool until the close."""

    @classmethod
    def open(
        cls,
        round_id: int,
        p: int,
        now: float,
        asked: set[int],
        values: Sequence[torch.Tensor],
        embedding_like: Sequence[bool],
        pieces: Sequence[Piece],
        buffers: Sequence[int],
        flat: torch.Tensor,
        cfg: DiLoCoConfig,
    ) -> Round:
        """Fragment p's round, asking ``asked``; its running merge lives in ``flat`` (lent)."""
        scratch, at = [], 0
        for v in values:
            scratch.append(flat[at : at + v.numel()].view(v.shape))
            at += v.numel()
        rda = [cfg.merge == "rda" and not emb and pc.kind == "param" for pc, emb in zip(pieces, embedding_like)]
        merge: list[Accumulator | RowAccumulator] = [Accumulator(t, rda=r) for t, r in zip(scratch, rda)]
        return cls(round_id, p, now, asked, cfg, pieces, buffers, merge=merge, scratch=flat, per_row=[False] * len(rda))

    def release(self) -> torch.Tensor | None:
        """Give the merge buffer back (the outer step is done with it)."""
        flat = self.scratch
        if flat is not None:
            self.scratch, self.merge = None, []
        return flat

    # -- answers -----------------------------------------------------------------------------

    def accept(
        self,
        c: Contribution,
        values: list[torch.Tensor],
        norms: list[float],
        now: float,
        cap: float | None,
        scale: float,
    ) -> None:
        """Queue an admitted answer (its outer gradient ``values``, per piece ``norms``): its
        token weight, clipped at ``cap``; ``scale``, its staleness discount."""
        old = self.pending.get(c.learner)
        if old is not None and not any(self.per_row):  # a newer answer replaces the older one: take it back out
            self.feed(old, sign=-1.0)
        weight, clipped = token_weight(c.tokens, c.steps), False
        if cap is not None and weight > cap:
            weight, clipped = cap, True
        # Its counters only: the tensors live on as ``values`` (its outer gradient, in place) and
        # the encoded payload, decoded, is no longer needed.
        meta = dataclasses.replace(c, values=[], encoded=[])
        pending = self.pending[c.learner] = Pending(meta, values, norms, weight, now, clipped, scale, claimed=weight)
        if self.cfg.expert_weights == "routed" and c.routed and c.tokens > 0:
            pending.factors = [
                row_factors(r, pc.row_start, pc.row_end) if r else None for r, pc in zip(c.routed, self.pieces)
            ]
        self.refused.discard(c.learner)
        if (old is not None and any(self.per_row)) or self.rows_apart() != self.per_row:
            self.rebuild()  # rows weighed apart start or stop: every answer goes in again
        else:
            self.feed(pending)
        if self.quorum_at is not None:
            self.in_grace.add(c.learner)  # admitted after the quorum was reached
        if self.first_answer_at is None:
            self.first_answer_at = now

    def refuse(self, r: Rejection) -> None:
        """Record a refusal of an answer to this round (the first MAX_REJECTIONS_PER_ROUND in full)."""
        self.rejected_total += 1
        if r.learner not in self.pending:
            self.refused.add(r.learner)
        if len(self.rejected) < MAX_REJECTIONS_PER_ROUND:
            self.rejected.append(r)

    def rows_apart(self) -> list[bool]:
        """The pieces every answer in the round has routed-token counts for (none unless
        ``expert_weights = "routed"``): those are merged row by row."""
        n = len(self.merge)
        answers = [pd for pd in self.pending.values() if pd.weight > 0]  # the others add nothing
        if self.cfg.expert_weights != "routed" or not answers:
            return [False] * n
        return [all(len(pd.factors) == n and pd.factors[i] is not None for pd in answers) for i in range(n)]

    def rebuild(self) -> None:
        """Rebuild the running sums from what remains (exact; a subtraction would leave residue),
        each piece merged as a whole or row by row as the answers now in the round allow."""
        self.per_row = self.rows_apart()
        self.merge = [
            RowAccumulator(acc.acc, acc.rda) if rows else Accumulator(acc.acc, acc.rda)
            for acc, rows in zip(self.merge, self.per_row)
        ]
        for pd in self.pending.values():
            self.feed(pd)

    def feed(self, pd: Pending, sign: float = 1.0) -> None:
        """Add one answer to the running merge (sign -1: take it back out). Statistics are a
        plain weighted mean of values: no staleness discount (it would shrink them)."""
        for i, (acc, d, n) in enumerate(zip(self.merge, pd.deltas, pd.norms)):
            scale = 1.0 if i in self.buffers else pd.scale
            if isinstance(acc, RowAccumulator):
                acc.add(d, n, pd.weight, sign=sign, scale=scale, factors=pd.factors[i] if pd.factors else None)
            else:
                acc.add(d, n, pd.weight, sign=sign, scale=scale)

    # -- quorum and grace --------------------------------------------------------------------

    def effective_quorum(self, live: set[int]) -> int:
        """K_eff = min(K, live learners that were asked); K = "all" (or a final round) means all."""
        live_asked = len(self.asked & live)
        k = self.cfg.quorum_size
        return live_asked if k is None or self.final else min(k, live_asked)

    def close_reason(self, now: float, live: set[int], t_step: float | None, t_sync: float) -> CloseReason | None:
        """Why the round may close at ``now`` (None: not yet). When its quorum is first reached,
        it sets ``quorum_at`` and its grace window (``t_step``: the fleet's step time; ``t_sync``:
        the sync path's)."""
        answered = set(self.pending)
        live_asked = self.asked & live
        done = answered | self.refused  # a refused learner has answered too: no round waits for it
        k_eff = self.effective_quorum(live)
        if not answered:
            if live_asked and live_asked <= done:
                return "all_answered"  # every answer was refused: close, merging nothing
            return "no_live_learners" if not live_asked and now > self.opened_at else None
        if len(answered) < max(k_eff, 1):
            return None
        if self.quorum_at is None and not (self.final or self.late):  # no quorum to learn the grace from
            self.quorum_at = sorted(pd.arrived_at for pd in self.pending.values())[max(k_eff, 1) - 1]
            t_quorum = self.quorum_at - self.opened_at
            self.grace_s = grace_window(self.cfg, t_step or 0.0, t_sync, t_quorum) if self.cfg.grace else 0.0
            self.grace_until = self.quorum_at + self.grace_s
        if live_asked <= done:
            return "final" if self.final else "all_answered"
        if self.final:
            return None  # the final sync waits for every live learner (or its liveness timeout)
        # The robust merge judges directions against a majority: a round waits for one (up to
        # one period of H steps, by when every live learner has had its chance to answer).
        few = self.cfg.robust and not self.late and len(answered) < min(robust.MIN_ANSWERS, len(live_asked))
        if few and t_step is not None and now < self.opened_at + self.cfg.sync_every * t_step:
            return None
        if not self.cfg.grace:
            return "quorum"
        if self.grace_until is not None and now >= self.grace_until:
            return "grace_over"
        return None

    # -- the close ---------------------------------------------------------------------------

    def screen(
        self,
        recent: Sequence[float],
        merged_rounds: int,
        trust: Mapping[int, float],
        drifts: Mapping[int, robust.Drift] | None = None,
        sketch: robust.Sketch | None = None,
    ) -> Screened:
        """Take the answers ``out_of_line`` finds out of the round and rebuild the merge without
        them (``judge`` when robust). ``recent``: the fragment's recent |delta| per step;
        ``merged_rounds``: its merged rounds with steps; ``trust``: each answer's sender's;
        ``drifts``: their drifts in this fragment (absent: none yet); ``sketch``: the
        fragment's (None: drift is not judged)."""
        if self.cfg.robust:
            return self.judge(recent, merged_rounds, trust, drifts or {}, sketch)
        found = out_of_line(
            {
                m: screened(pd.norms, pd.contribution.steps)
                for m, pd in self.pending.items()
                if pd.contribution.steps > 0
            },
            list(recent),
            merged_rounds,
            self.cfg,
        )
        out = Screened()
        if not found:
            return out
        for m, x, ref in found:  # recorded with the round, each with a strike
            out.refused.append((self.pending.pop(m).contribution, "outlier", outlier_detail(x, ref, self.cfg)))
        self.rebuild()
        return out

    def judge(
        self,
        recent: Sequence[float],
        merged_rounds: int,
        trust: Mapping[int, float],
        drifts: Mapping[int, robust.Drift],
        sketch: robust.Sketch | None,
    ) -> Screened:
        """The robust merge (``core/robust.py``): refuse misaligned answers, clip oversized
        ones, weigh each learner by its trust and its drift; rebuild the merge if anything
        changed."""
        cfg, out = self.cfg, Screened()
        judged = {m: pd for m, pd in self.pending.items() if pd.contribution.steps > 0}
        if not judged:
            return out
        history = history_reference(list(recent), merged_rounds, cfg)
        changed = self._clip_buffers(judged)
        params = [i for i in range(len(self.pieces)) if i not in self.buffers]
        if not params:
            if changed:
                self.rebuild()
            return out
        verdicts = robust.judge(
            {m: [pd.deltas[i] for i in params] for m, pd in judged.items()},
            {m: math.sqrt(sum(n * n for n in pd.norms)) for m, pd in judged.items()},
            {m: pd.contribution.steps for m, pd in judged.items()},
            history,
            cfg.robust_clip,
            sketch if cfg.robust_drift_limit > 0 else None,
        )
        # Only full-length answers (half the round's median steps) judge their learner: a few
        # steps are mostly noise.
        full_length = statistics.median(pd.contribution.steps for pd in judged.values()) / 2
        drifted = self._drifts(verdicts, judged, drifts, full_length, out)
        # No answer outweighs robust_weight_cap x the round's median (with a majority to take it from).
        weights = [pd.weight for pd in judged.values() if pd.weight > 0]
        weight_cap = None
        if cfg.robust_weight_cap > 0 and len(weights) >= robust.MIN_ANSWERS:
            weight_cap = cfg.robust_weight_cap * statistics.median(weights)
        for m, v in verdicts.items():
            pd, held = judged[m], trust[m]
            full = pd.contribution.steps >= full_length and not math.isnan(v.cosine)
            # Drift is evidence as a misalignment is: the trust falls to its target.
            target = drifted.get(m, 1.0)
            if full:
                held = out.trust[m] = robust.trust_after(held, min(v.alignment, target), cfg.robust_trust_decay)
            if full and v.alignment < cfg.robust_min_alignment:
                del self.pending[m]
                out.refused.append(
                    (pd.contribution, "misaligned", misaligned_detail(v.cosine, v.alignment, cfg))
                )  # fmt: skip
                changed = True
                continue
            trusted = robust.trust_factor(held, cfg.robust_trust_full)
            changed = self._weigh(pd, v, trusted, weight_cap, params, target) or changed
        if changed:
            self.rebuild()
        return out

    def _drifts(
        self,
        verdicts: Mapping[int, robust.Verdict],
        judged: Mapping[int, Pending],
        drifts: Mapping[int, robust.Drift],
        full_length: float,
        out: Screened,
    ) -> dict[int, float]:
        """Each full-length answer's residual added to its learner's drift (into ``out.drift``);
        returns, per learner whose drift is evidence (``robust.DRIFT_ROUNDS``), the trust its
        drift pulls it to (``robust.drift_target``). A drift is measured against the round's
        median drift: honest learners on data of their own repeat a part of their push too (a
        shard's own direction), and a minority cannot move the median."""
        cfg = self.cfg
        for m, v in verdicts.items():
            # (a few steps are mostly noise: they do not judge the learner)
            if v.residual is not None and judged[m].contribution.steps >= full_length:
                before = drifts.get(m, robust.Drift.empty(v.residual.numel()))
                out.drift[m] = before.add(v.residual, cfg.robust_drift_decay)
        pushes = {m: d.consistent() for m, d in out.drift.items() if d.rounds >= 2}
        if len(pushes) < robust.MIN_ANSWERS:
            return {}
        typical = statistics.median(pushes.values())
        targets = {}
        for m, push in pushes.items():
            level = push / typical if typical > 0 else 0.0
            judged[m].drift = level
            if out.drift[m].rounds >= robust.DRIFT_ROUNDS:
                targets[m] = robust.drift_target(level, cfg.robust_drift_limit)
        return targets

    def _weigh(
        self,
        pd: Pending,
        v: robust.Verdict,
        trusted: float,
        weight_cap: float | None,
        params: Sequence[int],
        drift_target: float = 1.0,
    ) -> bool:
        """One kept answer's size and weight after its verdict; True if either changed. Its
        weight follows its learner's trust, its alignment and its drift's target (evidence
        now: a pushing learner's answer loses its weight at once, its trust over rounds)."""
        cfg, changed = self.cfg, False
        if not math.isnan(v.cosine):
            pd.alignment = v.alignment
        aligned = min(1.0, max(v.alignment, 0.0) / cfg.robust_full_alignment)
        # Without a majority to weigh it against (a round of one or two), an answer alone
        # would be the whole merge whatever its weight: its size follows its trust. With
        # one, a half-aligned answer may be half as large: its size bound follows alignment.
        if math.isnan(v.cosine):
            shrink = v.clip * trusted
        else:  # (an answer of alignment 0 keeps its size: its weight is 0)
            shrink = min(1.0, v.room * aligned) if aligned > 0 else 1.0
        if shrink < 1.0:
            for i in params:
                pd.deltas[i].mul_(shrink)
            pd.norms, pd.shrunk, changed = [n * shrink for n in pd.norms], shrink, True
        if weight_cap is not None and pd.weight > weight_cap:
            pd.weight, pd.clipped, changed = weight_cap, True, True
        factor = trusted * min(aligned, drift_target)
        if factor < 1.0:
            pd.weight *= factor
            pd.clipped = changed = True
        return changed

    def _clip_buffers(self, judged: dict[int, Pending]) -> bool:
        """Bounded influence on the buffers: with a majority to measure against, each answer's
        statistic is clipped, coordinate by coordinate, to within ``robust_clip`` x the round's
        median distance from the round's median there. True if one was cut."""
        if not self.buffers or len(judged) < robust.MIN_ANSWERS or self.cfg.robust_clip <= 0:
            return False
        cut = False
        for i in self.buffers:
            answers = [pd.deltas[i] for pd in judged.values()]  # a buffer's "delta" is its value
            stacked = torch.stack(answers)
            centre = stacked.median(dim=0).values
            room = (stacked - centre).abs().median(dim=0).values.mul_(self.cfg.robust_clip)
            low, high = centre - room, centre + room
            for v in answers:
                if bool(((v < low) | (v > high)).any()):
                    torch.clamp(v, low, high, out=v)
                    cut = True
        return cut

    def close(
        self, now: float, reason: CloseReason, version: int, quorum: int, values: Sequence[torch.Tensor]
    ) -> Closed:
        """The round's result (call ``screen`` first): ``version`` and ``values`` are the
        fragment's current ones, ``quorum`` the effective quorum now. Buffers (running
        statistics, counts) become the token-weighted mean of the answers' values: no outer
        step, no momentum (it is fed zeros). Statistics are levels, not progress: changes from
        stale bases would add up. A count never falls."""
        pending = [self.pending[m] for m in sorted(self.pending)]
        record = RoundRecord(
            self.fragment,
            self.round_id,
            self.opened_at,
            now,
            version,
            quorum=quorum,
            grace_s=self.grace_s,
            close_reason=reason,
            rejected=self.rejected,
            rejected_total=self.rejected_total,
        )
        closed = Closed(record, pending, None, {}, self.in_grace)
        if pending and sum(pd.weight for pd in pending) > 0:
            merged = [acc.result() for acc in self.merge]
            for i in self.buffers:
                closed.stats[i] = merged[i].clone()
                if self.pieces[i].kind == "count":
                    torch.maximum(closed.stats[i].round_(), values[i], out=closed.stats[i])
                merged[i] = torch.zeros_like(closed.stats[i])
            closed.merged = merged
        return closed
