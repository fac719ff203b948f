"""The syncer as a state machine: handed events and the time, it returns what the driver must do.

Theory of operation.

State. Per fragment, a ``FragmentState`` (``core/versions.py``): its current values, the recent
versions it still accepts answers on (``keep_versions``), its outer optimizer and its screening
history. Per learner id, a ``LearnerInfo`` (``core/fleet.py``): incarnation, when last heard,
step time, the replay guard (seq per fragment), strikes, quarantine and trust. Per owned
fragment, at most one open ``Round`` (``core/round.py``). And the step clock (``tick``).

Events. ``handle(event, now)`` takes one learner message (``Join``, ``Leave``, ``Heartbeat``,
``Contribution``, ``Ack``), then polls; ``poll(now)`` advances the step clock, opens the rounds
due and closes those that may close; ``flush`` and ``final_sync`` end a run; ``view(now)`` is
read-only. ``now`` is the only clock. Every call returns an ``Output``: fragments to make
durable, tape records, then messages to send, in that order.

A round's life. Opened by the step clock (``t mod H = floor(p*H/P)``), asking every live
learner; by a lock-step push; or for one late answer (``staleness = "delayed"``). Each answer
runs through ``admission.ADMISSION``: refused (a strike if what it carried was wrong), or
accepted into the round's running merge. Quorum: once K_eff = min(K, live asked) answered, the
round sets its grace window from its quorum time. Closed when every live learner it asked has
answered or been refused, when the grace window ends (at the quorum itself without grace), when
no learner it asked is live, or by ``flush``; the robust merge first waits up to H steps for a
majority, a final round for every live learner. At the close the round screens its answers, the
syncer takes the outer step into a new version and sends it to the learners merged.

Invariants. A fragment's version only grows, by one per merged round, and is named durable in
the same ``Output`` that first carries it. At most one round per fragment is open. An answer
enters a merge at most once per (learner, incarnation, fragment, seq), only from a base version
still kept. What the syncer keeps is bounded by its learners and fragments, never by time.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ddiloco.core import admission, fleet, robust
from ddiloco.core.admission import STRIKES, Admitting, Sender, Shape
from ddiloco.core.codec import Chain
from ddiloco.core.compress import decode, is_lossy
from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.ema import Ema
from ddiloco.core.fleet import JoinRefusal, LearnerInfo
from ddiloco.core.fragments import (
    FragmentLayout,
    assemble,
    due_fragments,
    read_fragment,
    storage_bytes,
    take_fragment,
    tensor_rows,
)
from ddiloco.core.messages import (
    Ack,
    Contribution,
    FragmentRequest,
    FragmentUpdate,
    Heartbeat,
    Join,
    LearnerMessage,
    Leave,
    SyncerMessage,
    UpdateReason,
)
from ddiloco.core.outer import OuterNesterov
from ddiloco.core.round import Closed, Round, grace_window, screened, tokens
from ddiloco.core.tape import CloseReason, Late, Rejection, RejectReason, TapeRecord
from ddiloco.core.versions import FragmentRecord, FragmentState, Version, norm_of
from ddiloco.core.views import FragmentView, LearnerView, SyncerView

# (the records, refusals and views drivers read are defined beside what they describe)
__all__ = ["FragmentRecord", "JoinRefusal", "LearnerInfo", "Output", "Syncer", "SyncerView"]


@dataclass
class Output:
    """What the driver must do after a call, in this order: make ``durable`` fragments'
    current versions durable, keep the ``tape`` records, then send ``messages``."""

    messages: list[SyncerMessage] = field(default_factory=list)
    """Requests and updates to deliver, each addressed to one learner."""
    durable: list[int] = field(default_factory=list)
    """Fragments that got a new version in this call (in order, each at most once)."""
    tape: list[TapeRecord] = field(default_factory=list)
    """Event-tape records produced in this call."""
    refused: list[JoinRefusal] = field(default_factory=list)
    """Joins refused in this call: the driver tells each learner why."""

    def extend(self, other: Output) -> Output:
        self.refused += other.refused
        self.messages += other.messages
        self.durable += [p for p in other.durable if p not in self.durable]
        self.tape += other.tape
        return self


class Syncer:
    """Global state and round logic of Decoupled DiLoCo (and its lock-step baselines)."""

    def __init__(
        self,
        cfg: DiLoCoConfig,
        layout: FragmentLayout,
        initial: dict[str, torch.Tensor],
        embedding_like: Sequence[bool],
        owned: Sequence[int] | None = None,
        take: bool = False,
        sketch_seed: int = 0,
    ) -> None:
        """``take``: ``initial``'s tensors are the syncer's to keep (a driver that built the
        model for this and lets it go): fp32 fragments are views of them, not copies.
        ``sketch_seed``: the robust merge's drift sketches' signs (``robust.Sketch``); a
        runtime draws it anew at each start and tells no learner (one that knew it could aim a
        push at what the sketch misses)."""
        self.cfg = cfg
        self.sketch_seed = sketch_seed
        # Per fragment, each learner's drift (the robust merge's history; in memory only: a
        # restarted syncer rebuilds it within a few rounds, the trust it produced is kept).
        self.drifts: dict[int, dict[int, robust.Drift]] = {}
        self._sketches: dict[int, robust.Sketch] = {}
        self.layout = layout
        # A syncer shard owns a subset of the fragments; the others' rounds run elsewhere.
        self.owned = sorted(owned) if owned is not None else list(range(layout.num_fragments))
        self.fragments: list[FragmentState] = []
        for pieces in layout.fragments:
            vals = [v.float() for v in (take_fragment if take else read_fragment)(initial, pieces)]
            history = deque([Version(0, vals, -math.inf)], maxlen=cfg.keep_versions + 1)
            outer = OuterNesterov(cfg.outer_lr, cfg.outer_momentum, delayed=cfg.staleness == "delayed")
            frag = FragmentState(0, history, outer, norm=norm_of(vals))
            if is_lossy(cfg.down_payload):
                frag.chain = Chain(0, vals, start=0, keep=cfg.chain_history)
            self.fragments.append(frag)
        flat = list(embedding_like)
        if len(flat) != sum(len(f) for f in layout.fragments):
            raise ValueError("embedding_like needs one flag per piece of the layout")
        self._emb: list[list[bool]] = []
        for pieces in layout.fragments:
            self._emb.append(flat[: len(pieces)])
            flat = flat[len(pieces) :]
        # Per fragment, the positions of its buffer pieces (merged by their own rule, round.close);
        # rows (dim 0) of each tensor: what routed-token counts must match (``expert_weights``).
        self._buffers: list[list[int]] = [
            [i for i, pc in enumerate(pieces) if pc.kind != "param"] for pieces in layout.fragments
        ]
        self._numel = layout.sizes()
        self._shape = Shape(layout.fragments, self._buffers, self._numel, tensor_rows(layout), self.owned)
        self.learners: dict[int, LearnerInfo] = {}
        self.rounds: dict[int, Round] = {}
        self.tick = 0
        self.next_tick_at: float | None = None
        self.max_step_seen = 0
        self._round_ids = 0
        self._t_quorum = Ema(cfg.ema_decay)
        self._t_sync = Ema(cfg.ema_decay)
        # Per fragment, the newest version still waiting for its first ack: (version, closed_at, pull_s).
        self._awaiting_ack: dict[int, tuple[int, float, float]] = {}
        self.finishing = False
        """Set by ``flush(final=True)``: the run is ending and no scheduled round opens again."""
        self._final_todo: list[int] = []
        """The final sync's fragments not asked yet (``final_window`` are open at a time)."""
        self._keep_past_values = cfg.anchor != "base"
        # Merge accumulators, lent to open rounds and taken back at their close: as many as
        # rounds are open at once, not one per fragment (large fresh allocations would cost
        # page faults on every round; one per fragment would cost a whole model).
        self._scratch_pool: list[torch.Tensor] = []
        self._scratch_numel = max(self._numel) if self._numel else 0

    # -- events ------------------------------------------------------------------------------

    def handle(self, event: LearnerMessage, now: float) -> Output:
        """Take one learner message at time ``now``; return what to do about it (including
        whatever the advance of time to ``now`` caused)."""
        out = Output()
        if isinstance(event, Join):
            self._on_join(event, now, out)
        elif isinstance(event, Leave):
            info = self.learners.get(event.learner)
            if info is not None and info.incarnation == event.incarnation:
                info.left = True
        elif isinstance(event, Heartbeat):
            self._on_heartbeat(event, now)
        elif isinstance(event, Contribution):
            self._on_contribution(event, now, out)
        elif isinstance(event, Ack):
            self._on_ack(event, now)
        else:
            raise TypeError(f"not a learner message: {type(event).__name__}")
        return out.extend(self.poll(now))

    def _current(self, learner: int, incarnation: int) -> LearnerInfo | None:
        """The learner's record if ``incarnation`` is the registered, live-able one."""
        info = self.learners.get(learner)
        if info is None or info.left or info.incarnation != incarnation:
            return None
        return info

    def _on_join(self, j: Join, now: float, out: Output) -> None:
        """Register (or re-register) and send every owned fragment the learner lacks."""
        info = self.learners.get(j.learner)
        if info is not None and j.incarnation < info.incarnation:
            return  # a message of a process that was already replaced
        if info is None:
            if len(self.learners) >= self.cfg.max_learners:
                reason = f"the syncer registers at most algo.max_learners = {self.cfg.max_learners} learner ids"
                out.refused.append(JoinRefusal(j.learner, reason, 0.0))
                return
            info = self.learners[j.learner] = LearnerInfo(j.incarnation, now, Ema(self.cfg.ema_decay))
        if j.incarnation != info.incarnation:
            silent = now - info.last_heard
            if not info.left and silent < self.cfg.takeover_after_s:
                # Two processes with one id would read the same shard and count twice.
                reason = (
                    f"learner id {j.learner} is held by a live process (heard {silent:.1f} s ago); use another "
                    "id, or stop that process"
                )
                out.refused.append(JoinRefusal(j.learner, reason, self.cfg.takeover_after_s - silent))
                return
            info.incarnation, info.last_seq = j.incarnation, {}
            info.step_time = Ema(self.cfg.ema_decay)
        info.last_heard, info.left = now, False
        have = j.base_versions if len(j.base_versions) == len(self.fragments) else None
        info.held = {p: have[p] for p in self.owned} if have is not None else {}
        for p in self.owned:
            # A learner that already holds the current version (e.g. after a syncer restart)
            # keeps its local progress on it; one a few versions behind (restarted from its own
            # saved state) catches up by the chain's changes; everything else is sent in full.
            if have is None or have[p] != self.fragments[p].version:
                out.messages += self._join_updates(j.learner, p, have[p] if have is not None else None, now)

    def _on_heartbeat(self, hb: Heartbeat, now: float) -> None:
        info = self._current(hb.learner, hb.incarnation)
        if info is None:
            return  # unknown learners must join first
        info.last_heard = now
        # Only plausible step times drive the step clock (1e-12 would tick it without end).
        if self.cfg.min_step_time_s <= hb.step_time_s <= self.cfg.max_step_time_s:
            info.step_time.update(hb.step_time_s)
        self.max_step_seen = max(self.max_step_seen, hb.step)

    def _on_ack(self, ack: Ack, now: float) -> None:
        """The first ack of a version times the sync path (pull + merge + apply + send)."""
        info = self._current(ack.learner, ack.incarnation)
        if info is not None and ack.fragment in self.owned:
            info.held[ack.fragment] = max(info.held.get(ack.fragment, 0), ack.version)
        waiting = self._awaiting_ack.get(ack.fragment)
        if waiting is not None and waiting[0] == ack.version and info is not None:
            del self._awaiting_ack[ack.fragment]
            self._t_sync.update(waiting[2] + (now - waiting[1]))

    def _on_contribution(self, c: Contribution, now: float, out: Output) -> None:
        """Admit (``admission.ADMISSION``) and queue a contribution in its fragment's round; a
        lock-step push may open one."""
        info = self.learners.get(c.learner)
        sender = Sender(
            None if info is None or info.left else info.incarnation,
            info.last_seq.get(c.fragment, -1) if info is not None else -1,
            info.quarantine if info is not None else None,
        )
        a = Admitting(c, sender, self.fragments, self._shape, self.t_step(now), now, self.cfg)
        problem = admission.admit(a)
        if problem is not None:
            self._reject(c, *problem, now, out)
            if problem[0] == "stale_base":
                self._serve_stale(c, now, out)
            return
        info = self.learners[c.learner]
        info.last_heard = info.last_contribution_at = now
        info.held[c.fragment] = max(info.held.get(c.fragment, 0), c.base_version)
        self.max_step_seen = max(self.max_step_seen, c.step)
        rnd = self._round_for(c, now, out)
        if rnd is None:
            return
        info.last_seq[c.fragment] = c.seq
        info.strikes = 0
        info.quarantine = None  # it answered from a fresh version: it has re-synced
        version = self.fragments[c.fragment].version
        scale = 1.0 / (1 + version - c.base_version) if self.cfg.staleness == "scaled" else 1.0
        rnd.accept(c, a.values, a.norms, now, self.weight_cap(now), scale)

    def _serve_stale(self, c: Contribution, now: float, out: Output) -> None:
        """Send the current value so the learner rebases instead of retrying forever; once per
        version, so stale answers cannot turn the syncer into an amplifier."""
        info, version = self.learners[c.learner], self.fragments[c.fragment].version
        if info.stale_served.get(c.fragment) != version:
            info.stale_served[c.fragment] = version
            out.messages.append(self._update(c.learner, c.fragment, "stale", now))

    def _round_for(self, c: Contribution, now: float, out: Output) -> Round | None:
        """The round an admitted answer enters (None: it missed its round, recorded as late)."""
        rnd = self.rounds.get(c.fragment)
        if rnd is None and self.cfg.staleness == "delayed" and self.cfg.late_fragment != "wait" and not self.finishing:
            # Missed its round: merged at once into a version of its own, as its share of the fleet.
            rnd = self._open(c.fragment, now)
            rnd.asked, rnd.late = {c.learner}, True
        if rnd is None:
            if self.cfg.late_fragment != "wait" or self.finishing:
                # Missed its round: the learner keeps its progress and contributes it later (at
                # the run's end, the final sync asks for it).
                out.tape.append(Late(c.learner, c.fragment, now))
                return None
            rnd = self._open(c.fragment, now)  # lock-step learners push on their own schedule
        return rnd

    def weight_cap(self, now: float) -> float | None:
        """The cap on one contribution's weight now (``admission.weight_cap`` over the live
        learners' recent accepted weights)."""
        return admission.weight_cap((list(self.learners[m].recent_weights) for m in self.live(now)), self.cfg)

    def _reject(self, c: Contribution, reason: RejectReason, detail: str, now: float, out: Output) -> None:
        r = Rejection(c.learner, c.fragment, reason, detail, now)
        rnd = self.rounds.get(c.fragment)
        if rnd is None:
            out.tape.append(r)
        else:
            rnd.refuse(r)
        info = self.learners.get(c.learner)
        if reason not in STRIKES or info is None or info.incarnation != c.incarnation:
            return
        info.strikes += 1
        if self.cfg.quarantine_after and info.strikes >= self.cfg.quarantine_after and info.quarantine is None:
            # Send it every fragment; until it answers from them, its answers are refused.
            info.quarantine = {p: self.fragments[p].version for p in self.owned}
            out.messages += [self._update(c.learner, p, "stale", now) for p in self.owned]
            detail = f"quarantined after {info.strikes} refused contributions in a row; sent every fragment to re-sync"
            out.tape.append(Rejection(c.learner, c.fragment, "quarantined", detail, now))

    # -- membership and liveness -------------------------------------------------------------

    def registered(self, learner: int) -> int | None:
        """The incarnation registered for ``learner`` (None: unknown, or it left)."""
        info = self.learners.get(learner)
        return None if info is None or info.left else info.incarnation

    def live(self, now: float) -> list[int]:
        """Learners heard from within the liveness timeout (and not left), sorted."""
        return fleet.live(self.learners, now, self.cfg.liveness_timeout_s)

    def t_step(self, now: float) -> float | None:
        """The fleet's step time (``fleet.step_time`` over the live learners' EMAs; None before
        any is known)."""
        return fleet.step_time([self.learners[m].step_time.value for m in self.live(now)])

    def data_position(self, learner: int) -> int:
        """Where the learner's data shard resumes (its last merged contribution's position)."""
        info = self.learners.get(learner)
        return 0 if info is None else info.data_position

    @property
    def merged_tokens(self) -> float:
        """Tokens merged into the global model (mean over this syncer's fragments)."""
        return sum(self.fragments[p].tokens_merged for p in self.owned) / max(1, len(self.owned))

    # -- rounds ------------------------------------------------------------------------------

    def _open(self, p: int, now: float) -> Round:
        self._round_ids += 1
        flat = self._scratch_pool.pop() if self._scratch_pool else torch.empty(self._scratch_numel)
        rnd = Round.open(
            self._round_ids, p, now, set(self.live(now)), self.fragments[p].values, self._emb[p],
            self.layout.fragments[p], self._buffers[p], flat, self.cfg,
        )  # fmt: skip
        self.rounds[p] = rnd
        return rnd

    def poll(self, now: float) -> Output:
        """Advance the step clock to ``now``, open due rounds, close rounds that may close."""
        out = Output()
        if self.cfg.late_fragment == "continue" and not self.finishing:
            self._advance_clock(now, out)
        # (liveness and step times change only with a learner's message, never within a poll)
        live, t_step = set(self.live(now)), self.t_step(now)
        for p in sorted(self.rounds):
            rnd = self.rounds[p]
            reached = rnd.quorum_at is not None
            reason = rnd.close_reason(now, live, t_step, self._t_sync.get())
            if not reached and rnd.quorum_at is not None:
                self._t_quorum.update(rnd.quorum_at - rnd.opened_at)
            if reason is not None:
                self._close(rnd, now, reason, out)
        if self._final_todo:
            self._open_final(now, out)
        return out

    def _advance_clock(self, now: float, out: Output) -> None:
        t_step = self.t_step(now)
        if t_step is None:
            return
        if self.next_tick_at is None:
            self.next_tick_at = now + t_step
        if now - self.next_tick_at > self.cfg.sync_every * t_step:
            self.next_tick_at = now  # long absence: resume the schedule, don't replay it
        # A tick scheduled by a far slower clock (a learner reporting absurd step times, since
        # gone) comes within two of today's periods: the clock recovers at once.
        self.next_tick_at = min(self.next_tick_at, now + 2 * t_step)
        # Bounded by construction: at most one period of ticks per call, whatever t_step is.
        for _ in range(self.cfg.sync_every + 1):
            if self.next_tick_at > now:
                break
            self.tick += 1
            opened_at = self.next_tick_at
            live = self.live(now)
            for p in due_fragments(self.tick, len(self.fragments), self.cfg.sync_every):
                if p in self.rounds or not live or p not in self.owned:
                    continue  # the previous round of p is still open, or nobody to ask
                rnd = self._open(p, opened_at)
                out.messages += [FragmentRequest(m, p, rnd.round_id) for m in live]
            self.next_tick_at += t_step
        else:
            self.next_tick_at = max(self.next_tick_at, now)

    def outer_lr(self) -> float:
        """The outer LR now: constant, or a cosine over the merged tokens (outer_lr_decay_tokens)."""
        total = self.cfg.outer_lr_decay_tokens
        if total <= 0:
            return self.cfg.outer_lr
        frac = min(1.0, self.merged_tokens / total)
        return self.cfg.outer_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    def effective_quorum(self, rnd: Round, now: float) -> int:
        """K_eff = min(K, live learners that were asked); K = "all" (or a final round) means all."""
        return rnd.effective_quorum(set(self.live(now)))

    def grace_window(self, t_quorum: float, now: float) -> float:
        """grace = clamp(gamma*(tau*t_step - t_quorum - t_sync), 0, max_grace_steps*t_step)."""
        return grace_window(self.cfg, self.t_step(now) or 0.0, self._t_sync.get(), t_quorum)

    def _close(self, rnd: Round, now: float, reason: CloseReason, out: Output) -> None:
        """Screen the round, take the outer step if it merged anything, and send the new version
        to the learners merged in it."""
        p = rnd.fragment
        frag = self.fragments[p]
        drifts = self.drifts.setdefault(p, {})
        if p not in self._sketches:
            self._sketches[p] = robust.Sketch(self.sketch_seed * 1_000_003 + p)
        trust = {m: self.learners[m].trust for m in rnd.pending}
        screen = rnd.screen(frag.recent_norms, frag.screen_rounds, trust, drifts, self._sketches[p])
        for m, trust_after in screen.trust.items():
            self.learners[m].trust = trust_after
        drifts.update(screen.drift)
        for c, why, detail in screen.refused:  # recorded with the round, each with a strike
            self._reject(c, why, detail, now, out)
        del self.rounds[p]
        closed = rnd.close(now, reason, frag.version, self.effective_quorum(rnd, now), frag.values)
        if closed.merged is not None:
            self._step(rnd, closed, closed.merged, now, out)
        frag.screen_rounds += any(pd.contribution.steps > 0 for pd in closed.pending)
        for pd in closed.pending:
            c, info = pd.contribution, self.learners[pd.contribution.learner]
            if c.steps > 0:  # the screening's and the weight cap's references: merged answers only
                frag.recent_norms.append(screened(pd.norms, c.steps))
            if pd.weight > 0 and not rnd.final:
                # The final sync's answers carry whatever is left, often a few steps: as the weight
                # cap's reference they would clip the later final rounds' honest answers.
                info.recent_weights.append(pd.claimed)
            info.data_position = max(info.data_position, c.data_position)
        closed.record.merged += closed.entries(closed.record.version)
        out.tape.append(closed.record)
        # The new version goes to the learners merged in this round; others ask when they need it.
        out.messages += [self._update(pd.contribution.learner, p, "merged", now) for pd in closed.pending]
        if frag.chain is not None:
            frag.chain.delta = None  # its messages are made: the messages hold it until they are sent
        self._release(rnd)

    def _step(self, rnd: Round, closed: Closed, merged: list[torch.Tensor], now: float, out: Output) -> None:
        """The outer step of a merged round: fragment p's next version, to be made durable."""
        p, frag, weights = rnd.fragment, self.fragments[rnd.fragment], [pd.weight for pd in closed.pending]
        frag.outer.lr = self.outer_lr()
        frag.version += 1
        # The part of the live fleet this merge stands for (only a delayed outer step uses it).
        share = sum(1 for w in weights if w > 0) / max(1, len(self.live(now))) if frag.outer.delayed else 1.0
        new_values = frag.outer.step(frag.values, merged, share)
        for i, value in closed.stats.items():
            new_values[i] = value
        frag.push(Version(frag.version, new_values, now), self._keep_past_values, self._buffers[p])
        if frag.chain is not None:
            frag.chain.advance(frag.version, new_values, self.layout.fragments[p], self.cfg.down_payload)
        frag.norm = norm_of(new_values)
        frag.tokens_merged += sum(tokens(pd) for pd in closed.pending)
        frag.last_merged, frag.last_grace_s = sum(1 for w in weights if w > 0), rnd.grace_s
        closed.record.version = frag.version
        out.durable.append(p)
        pull_s = (rnd.first_answer_at or now) - rnd.opened_at
        self._awaiting_ack[p] = (frag.version, now, pull_s)

    def _release(self, rnd: Round) -> None:
        """Take a closed round's merge buffer back (the outer step is done with it)."""
        flat = rnd.release()
        if flat is not None:
            self._scratch_pool.append(flat)

    def flush(self, now: float, final: bool = False) -> Output:
        """Close every open round with what it has. ``final``: the run is ending, so no
        scheduled round opens again (the final sync's rounds come from ``final_sync``)."""
        self.finishing = self.finishing or final
        if final:
            self._final_todo = []  # the run's end cannot wait for them: their last progress stays local
        out = Output()
        for p in sorted(self.rounds):
            rnd = self.rounds[p]
            if rnd.pending:
                self._close(rnd, now, "flush", out)
            else:
                del self.rounds[p]
                self._release(rnd)
        return out

    def final_sync(self, now: float) -> Output:
        """The run's last round of every fragment: ask every live learner for the progress it
        has not contributed yet, and merge what they all send (no quorum, no grace).

        Call it once the learners have stopped training and have applied the versions of
        ``flush(now, final=True)``: an answer is anchored at the learner's base version, so a
        learner that had not applied its last merged version would count that progress twice.
        A final round closes when every live learner it asked has answered (or has left, or
        has gone silent past the liveness timeout); ``rounds`` is empty once all have closed.
        """
        self.finishing = True
        self._final_todo = list(self.owned)
        out = Output()
        self._open_final(now, out)
        return out.extend(self.poll(now))

    @property
    def final_window(self) -> int:
        """Final rounds open at once: as many as the schedule opens per step, and one more so
        that the next is asked while one closes. Every learner answers every open final round
        at once, so all of them open together would hold (learners + 1) copies of the model."""
        return math.ceil(len(self.fragments) / self.cfg.sync_every) + 1

    @property
    def final_left(self) -> int:
        """Fragments the final sync has not closed yet (open, or waiting for the window)."""
        return len(self._final_todo) + sum(1 for r in self.rounds.values() if r.final)

    def _open_final(self, now: float, out: Output) -> None:
        """Ask for the next fragments of the final sync while the window has room."""
        live = self.live(now)
        while self._final_todo and sum(1 for r in self.rounds.values() if r.final) < self.final_window:
            p = self._final_todo.pop(0)
            rnd = self.rounds.get(p)
            if rnd is None:
                rnd = self._open(p, now)
            rnd.final, rnd.asked, rnd.grace_until = True, rnd.asked | set(live), None
            out.messages += [FragmentRequest(m, p, rnd.round_id) for m in live if m not in rnd.pending]

    def next_deadline(self, now: float) -> float | None:
        """The next time ``poll`` could change something without a new message."""
        times = []
        # A tick in the past (no learner live: the step clock waits) is no deadline: a driver would spin.
        tick = self.next_tick_at
        if self.cfg.late_fragment == "continue" and tick is not None and tick > now and not self.finishing:
            times.append(tick)
        for rnd in self.rounds.values():
            if rnd.grace_until is not None and rnd.grace_until > now:
                times.append(rnd.grace_until)
            for m in rnd.asked - set(rnd.pending):
                info = self.learners.get(m)
                if info is not None and not info.left:
                    expiry = info.last_heard + self.cfg.liveness_timeout_s
                    if expiry >= now:
                        times.append(math.nextafter(expiry, math.inf))
        return min(times) if times else None

    # -- outputs -----------------------------------------------------------------------------

    def _update(self, learner: int, p: int, reason: UpdateReason, now: float) -> FragmentUpdate:
        """Fragment p's current version for ``learner``: with a lossy down-link, the chain's change
        when the learner holds the version before it, else the chain's values in full (exact)."""
        frag = self.fragments[p]
        live = max(1, len(self.live(now)))
        chain = frag.chain
        if chain is None:
            return FragmentUpdate(
                learner, p, frag.version, frag.values, self.merged_tokens, live, self.max_step_seen, reason
            )
        info = self.learners.get(learner)
        held = info.held.get(p) if info is not None else None
        if reason == "merged" and chain.can_chain(held) and chain.delta is not None:
            encoded, decoded = chain.delta
            return FragmentUpdate(
                learner, p, frag.version, decoded, self.merged_tokens, live, self.max_step_seen, reason,
                kind="delta", base_version=chain.version - 1, encoded=encoded,
            )  # fmt: skip
        return FragmentUpdate(
            learner, p, frag.version, chain.served, self.merged_tokens, live, self.max_step_seen, reason
        )

    def _join_updates(self, learner: int, p: int, held: int | None, now: float) -> list[FragmentUpdate]:
        """What brings a joining learner that holds version ``held`` of p (None: nothing) to the
        current version: the chain's encoded changes since ``held``, oldest first, when the
        chain keeps them all and they cost fewer bytes than the fragment; else the version in
        full. The changes reconstruct exactly what the chain serves, as the merged deltas do."""
        chain = self.fragments[p].chain
        changes = chain.catch_up(held) if chain is not None and held is not None else None
        if chain is None or not changes:
            return [self._update(learner, p, "join", now)]
        full = storage_bytes(chain.served)
        if sum(e.nbytes for _, enc in changes for e in enc) >= full:
            return [self._update(learner, p, "join", now)]
        live = max(1, len(self.live(now)))
        return [
            FragmentUpdate(
                learner,
                p,
                version,
                [decode(e) for e in encoded],
                self.merged_tokens,
                live,
                self.max_step_seen,
                "join",
                kind="delta",
                base_version=version - 1,
                encoded=encoded,
            )  # fmt: skip
            for version, encoded in changes
        ]

    def global_state(self) -> dict[str, torch.Tensor]:
        """The global model as a name -> tensor map (row-split pieces joined back)."""
        return assemble(self.layout, {p: frag.values for p, frag in enumerate(self.fragments)})

    def view(self, now: float, max_listed: int | None = None) -> SyncerView:
        """The fleet and the owned fragments at ``now``, read-only (``max_listed``: at most that
        many learners and fragments, lowest first)."""
        live = self.live(now)
        learners = []
        for m in sorted(self.learners)[:max_listed]:
            info = self.learners[m]
            state = "up" if m in live else "left" if info.left else "down"
            held = tuple(sorted((p, v) for p, v in info.held.items() if p in self.owned))
            learners.append(
                LearnerView(m, info.incarnation, state, info.last_heard, info.step_time.value,
                            info.last_contribution_at, held)
            )  # fmt: skip
        fragments = [
            FragmentView(p, f.version, f.made_at(f.version), f.last_merged, f.last_grace_s, f.tokens_merged,
                         p in self.rounds)
            for p in self.owned[:max_listed]
            for f in (self.fragments[p],)
        ]  # fmt: skip
        return SyncerView(tuple(live), tuple(learners), tuple(fragments), self.merged_tokens, len(self.learners))

    def values(self, p: int) -> list[torch.Tensor]:
        """Fragment p's current global values, one tensor per piece (the core's own: read them,
        copy them, never write them)."""
        return self.fragments[p].values

    def held_bytes(self) -> dict[str, int]:
        """The bytes of tensors this core holds, by what they are for (summed over the owned
        fragments): ``values`` (the current version), ``momentum`` (the outer optimizer's state,
        a delayed optimizer's pending share included), ``chain`` (the served copy of a lossy
        down-link, where it is not the values themselves), ``chain_history`` (its last encoded
        changes, ``algo.chain_history``), ``past`` (buffers of past versions),
        ``pending`` (open rounds' outer gradients, one per answer), ``scratch`` (merge
        buffers, open rounds' and the pool's) and ``drift`` (the robust merge's history: a
        sketch per learner and fragment, and each fragment's sketch signs). docs/runtime.md
        states the budget."""

        held: dict[str, list[torch.Tensor]] = {
            k: [] for k in ("values", "momentum", "chain", "chain_history", "past", "pending", "scratch", "drift")
        }
        for p in self.owned:
            f = self.fragments[p]
            held["values"] += f.values
            held["momentum"] += [*(f.outer.buffers or ()), *(f.outer.pending or ())]
            if f.chain is not None and any(a is not b for a, b in zip(f.chain.served, f.values)):
                held["chain"] += f.chain.served
            if f.chain is not None:
                held["chain_history"] += f.chain.history_tensors()
            held["past"] += [t for v in list(f.history)[:-1] for t in v.values]
        for rnd in self.rounds.values():
            held["pending"] += [t for pd in rnd.pending.values() for t in pd.deltas]
            held["scratch"] += [rnd.scratch] if rnd.scratch is not None else []
        held["scratch"] += self._scratch_pool
        held["drift"] += [d.total for p in self.owned for d in self.drifts.get(p, {}).values()]
        held["drift"] += [t for p in self.owned if p in self._sketches for t in self._sketches[p].held()]
        # A change's exact buffers are the version's own tensors: counted where they are held.
        counted = {t.untyped_storage().data_ptr() for k, ts in held.items() if k != "chain_history" for t in ts}
        held["chain_history"] = [t for t in held["chain_history"] if t.untyped_storage().data_ptr() not in counted]
        # (each storage once: fragments may be views of one tensor, as a fresh run's version 0 is)
        return {k: storage_bytes(ts) for k, ts in held.items()}

    @property
    def open_rounds(self) -> int:
        """Rounds open now (the final sync is over when none is)."""
        return len(self.rounds)

    def embedding_like(self) -> list[bool]:
        """Per piece, in fragment order: merged by weighted mean (as the constructor was given)."""
        return [flag for flags in self._emb for flag in flags]

    def versions(self) -> list[int]:
        return [f.version for f in self.fragments]

    # -- durable state (the driver decides where and when to write it) -----------------------

    def fragment_record(self, p: int) -> FragmentRecord:
        """Fragment p's current durable state."""
        return self.fragments[p].record(p)

    def load_fragment_record(self, rec: FragmentRecord, take: bool = False) -> None:
        """Restore a fragment from ``fragment_record`` output (older versions are not kept:
        contributions based on them are answered with the current value). ``take``: the
        record's tensors are the syncer's to keep (a store read them for it), not copied."""
        self.fragments[rec.fragment].load(rec, take)

    def restore(self, records: dict[int, FragmentRecord], meta: dict[str, Any] | None, take: bool = False) -> None:
        """Take back what a store made durable (``fragment_record`` and ``meta_state`` output).
        A fragment's version never goes backwards: an older record than the current one is not
        loaded. ``take``: the records' tensors are the syncer's to keep (not copied)."""
        for p, rec in records.items():
            if rec.version >= self.fragments[p].version:
                self.load_fragment_record(rec, take)
        if meta is not None:
            self.load_meta_state(meta)

    def meta_state(self) -> dict[str, Any]:
        """Everything else worth keeping across a restart (JSON-able)."""
        return {
            "tick": self.tick,
            "max_step_seen": self.max_step_seen,
            "round_ids": self._round_ids,
            "learners": {str(m): i.meta() for m, i in self.learners.items()},
            # The merge bounds' references survive a restart: else they would be off until rebuilt.
            "recent_norms": {str(p): list(self.fragments[p].recent_norms) for p in self.owned},
            "screen_rounds": {str(p): self.fragments[p].screen_rounds for p in self.owned},
        }

    def load_meta_state(self, meta: dict[str, Any]) -> None:
        """Restore ``meta_state`` output; restored learners are not live until they join."""
        self.tick = int(meta["tick"])
        self.max_step_seen = int(meta["max_step_seen"])
        self._round_ids = int(meta["round_ids"])
        for m, rec in meta["learners"].items():
            info = self.learners.setdefault(
                int(m), LearnerInfo(int(rec["incarnation"]), -math.inf, Ema(self.cfg.ema_decay))
            )
            info.load_meta(rec)
        for p, norms in meta.get("recent_norms", {}).items():
            if int(p) in self.owned:
                self.fragments[int(p)].recent_norms.extend(float(x) for x in norms)
        for p, n in meta.get("screen_rounds", {}).items():
            if int(p) in self.owned:
                self.fragments[int(p)].screen_rounds = int(n)
