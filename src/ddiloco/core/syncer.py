"""The syncer as a state machine: handed messages and the time, it returns messages.

It holds the global fragments, their versions and outer-optimizer state, opens rounds on a
step clock (or when a lock-step learner pushes), decides quorum and grace from ``now``, merges
with token weights and keeps the event tape. It never reads a clock, sleeps or does I/O.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.ema import Ema
from ddiloco.core.fragments import FragmentLayout, due_fragments
from ddiloco.core.merge import merge_deltas, token_weight
from ddiloco.core.messages import Ack, Contribution, FragmentRequest, FragmentUpdate, Heartbeat, Rejection, RoundRecord
from ddiloco.core.outer import OuterNesterov
from ddiloco.core.validation import check_counters, check_delta_norm, check_payload

Outgoing = FragmentRequest | FragmentUpdate


@dataclass
class LearnerInfo:
    """What the syncer knows of one learner."""

    last_heard: float
    step_time: Ema
    left: bool = False
    data_position: int = 0


@dataclass
class FragmentState:
    """Global values of one fragment, its recent versions and its outer optimizer."""

    version: int
    history: deque  # of (version, values), newest last, at most keep_versions long
    outer: OuterNesterov
    tokens_merged: int = 0

    @property
    def values(self) -> list[torch.Tensor]:
        return self.history[-1][1]

    def at(self, version: int) -> list[torch.Tensor] | None:
        for v, vals in self.history:
            if v == version:
                return vals
        return None


@dataclass
class Round:
    """One open round of one fragment."""

    round_id: int
    fragment: int
    opened_at: float
    asked: set[int]
    pending: dict[int, Contribution] = field(default_factory=dict)
    deltas: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # anchored on arrival
    arrived_at: dict[int, float] = field(default_factory=dict)
    first_answer_at: float | None = None
    quorum_at: float | None = None
    grace_until: float | None = None
    grace_s: float = 0.0
    in_grace: set[int] = field(default_factory=set)
    rejected: list[dict] = field(default_factory=list)


class Syncer:
    """Global state and round logic of Decoupled DiLoCo (and its lock-step baselines)."""

    def __init__(self, cfg: DiLoCoConfig, layout: FragmentLayout, initial: dict[str, torch.Tensor], embedding_like: Sequence[bool] | None = None, owned: Sequence[int] | None = None) -> None:
        from ddiloco.core.fragments import read_fragment

        self.cfg = cfg
        self.layout = layout
        # A syncer shard owns a subset of the fragments; the others' rounds run elsewhere.
        self.owned = sorted(owned) if owned is not None else list(range(layout.num_fragments))
        self.new_versions: list[tuple[int, int]] = []  # (fragment, version) not yet made durable
        self.fragments = []
        for pieces in layout.fragments:
            vals = [v.float() for v in read_fragment(initial, pieces)]
            self.fragments.append(FragmentState(0, deque([(0, vals)], maxlen=cfg.keep_versions + 1), OuterNesterov(cfg.outer_lr, cfg.outer_momentum)))
        if embedding_like is None:
            embedding_like = [any(s in pc.name for s in cfg.embedding_patterns) for frag in layout.fragments for pc in frag]
        flat = list(embedding_like)
        self._emb: list[list[bool]] = []
        for pieces in layout.fragments:
            self._emb.append(flat[: len(pieces)])
            flat = flat[len(pieces) :]
        self.learners: dict[int, LearnerInfo] = {}
        self.rounds: dict[int, Round] = {}
        self.tape: list[dict] = []
        self.rejections: list[Rejection] = []
        self.tick = 0
        self.next_tick_at: float | None = None
        self.max_step_seen = 0
        self._round_ids = 0
        self._t_quorum = Ema(cfg.ema_decay)
        self._t_sync = Ema(cfg.ema_decay)
        self._awaiting_ack: dict[tuple[int, int], tuple[float, float]] = {}  # (p, version) -> (closed_at, pull_s)

    # -- membership and liveness -------------------------------------------------------------

    def on_join(self, learner: int, now: float) -> list[Outgoing]:
        """A (re)joining learner: mark it live and send it every current global fragment."""
        info = self.learners.get(learner)
        if info is None:
            info = self.learners[learner] = LearnerInfo(now, Ema(self.cfg.ema_decay))
        info.last_heard, info.left = now, False
        out: list[Outgoing] = [self._update(learner, p, "join", now) for p in self.owned]
        return out + self.poll(now)

    def on_leave(self, learner: int, now: float) -> list[Outgoing]:
        """A clean leave: the learner stops counting as live at once."""
        if learner in self.learners:
            self.learners[learner].left = True
        return self.poll(now)

    def on_heartbeat(self, hb: Heartbeat, now: float) -> list[Outgoing]:
        info = self.learners.get(hb.learner)
        if info is None or info.left:
            return []  # unknown learners must join first
        info.last_heard = now
        if hb.step_time_s > 0:
            info.step_time.update(hb.step_time_s)
        self.max_step_seen = max(self.max_step_seen, hb.step)
        return self.poll(now)

    def live(self, now: float) -> list[int]:
        """Learners heard from within the liveness timeout (and not left), sorted."""
        return sorted(m for m, i in self.learners.items() if not i.left and now - i.last_heard <= self.cfg.liveness_timeout_s)

    def t_step(self, now: float) -> float | None:
        """Median over live learners of their step-time EMAs (None before any is known)."""
        times = [self.learners[m].step_time.value for m in self.live(now) if self.learners[m].step_time.value]
        return statistics.median(times) if times else None

    @property
    def global_tokens(self) -> float:
        """Tokens merged into the global model (mean over this syncer's fragments)."""
        return sum(self.fragments[p].tokens_merged for p in self.owned) / max(1, len(self.owned))

    # -- contributions ---------------------------------------------------------------------

    def on_ack(self, ack: Ack, now: float) -> None:
        """The first ack of a version times the sync path (pull + merge + apply + send)."""
        key = (ack.fragment, ack.version)
        if key in self._awaiting_ack:
            closed_at, pull_s = self._awaiting_ack.pop(key)
            self._t_sync.update(pull_s + (now - closed_at))

    def on_contribution(self, c: Contribution, now: float) -> list[Outgoing]:
        """Validate and queue a contribution; may open (lock-step) or close a round."""
        out: list[Outgoing] = []
        delta: list[torch.Tensor] = []
        reason = self._invalid(c)
        if reason is None:
            frag = self.fragments[c.fragment]
            base = frag.at(c.base_version)
            if base is None:
                reason = f"stale base version {c.base_version} (current {frag.version}, keeping {self.cfg.keep_versions})"
                # Send the current value so the learner rebases instead of retrying forever.
                out.append(self._update(c.learner, c.fragment, "stale", now))
            else:
                # The fragment only changes when its round closes, so the anchored delta
                # computed now is the one the merge will use.
                delta = self._delta(c, frag)
                reason = check_delta_norm(delta, self.cfg)
        if reason is not None:
            self._reject(c.learner, c.fragment, reason, now)
            return out + self.poll(now)
        self.learners[c.learner].last_heard = now
        self.max_step_seen = max(self.max_step_seen, c.step)
        rnd = self.rounds.get(c.fragment)
        if rnd is None:
            if self.cfg.late_fragment != "wait":
                # Missed its round: the learner keeps its progress and contributes it later.
                self.tape.append({"event": "late", "learner": c.learner, "fragment": c.fragment, "time": now})
                return out + self.poll(now)
            rnd = self._open(c.fragment, now)  # lock-step learners push on their own schedule
        rnd.pending[c.learner] = c  # at most one per (learner, fragment): newer replaces older
        rnd.deltas[c.learner] = delta
        rnd.arrived_at[c.learner] = now
        if rnd.quorum_at is not None:
            rnd.in_grace.add(c.learner)  # admitted after the quorum was reached
        if rnd.first_answer_at is None:
            rnd.first_answer_at = now
        return out + self.poll(now)

    def _invalid(self, c: Contribution) -> str | None:
        info = self.learners.get(c.learner)
        if info is None or info.left:
            return f"unknown learner {c.learner}: learners must join before contributing"
        if not 0 <= c.fragment < len(self.fragments):
            return f"unknown fragment {c.fragment} (the layout has {len(self.fragments)})"
        if c.fragment not in self.owned:
            return f"fragment {c.fragment} is owned by another syncer shard"
        if c.base_version > self.fragments[c.fragment].version or c.base_version < 0:
            return f"base version {c.base_version} was never issued (current {self.fragments[c.fragment].version})"
        return check_counters(c.steps, c.tokens, self.cfg) or check_payload(c, self.layout.fragments[c.fragment])

    def _delta(self, c: Contribution, frag: FragmentState) -> list[torch.Tensor]:
        """Outer gradient Theta[anchor] - theta_m, anchored at the learner's own base version."""
        base = frag.at(c.base_version)
        assert base is not None
        if c.kind == "delta" and self.cfg.anchor == "base":
            return list(c.values)
        theta = c.values if c.kind == "values" else [b - d for b, d in zip(base, c.values)]
        anchor = base if self.cfg.anchor == "base" else frag.values
        return [a - t for a, t in zip(anchor, theta)]

    def _reject(self, learner: int, fragment: int, reason: str, now: float) -> None:
        r = Rejection(learner, fragment, reason, now)
        self.rejections.append(r)
        rnd = self.rounds.get(fragment)
        if rnd is not None:
            rnd.rejected.append(r.to_json())
        else:
            self.tape.append(r.to_json())

    # -- rounds ------------------------------------------------------------------------------

    def _open(self, p: int, now: float) -> Round:
        self._round_ids += 1
        rnd = Round(self._round_ids, p, now, set(self.live(now)))
        self.rounds[p] = rnd
        return rnd

    def poll(self, now: float) -> list[Outgoing]:
        """Advance the step clock to ``now``, open due rounds, close rounds that may close."""
        out: list[Outgoing] = []
        if self.cfg.late_fragment == "continue":
            out += self._advance_clock(now)
        for p in sorted(self.rounds):
            rnd = self.rounds[p]
            reason = self._close_reason(rnd, now)
            if reason is not None:
                out += self._close(rnd, now, reason)
        return out

    def _advance_clock(self, now: float) -> list[Outgoing]:
        t_step = self.t_step(now)
        if t_step is None:
            return []
        if self.next_tick_at is None:
            self.next_tick_at = now + t_step
        if now - self.next_tick_at > self.cfg.sync_every * t_step:
            self.next_tick_at = now  # long absence: resume the schedule, don't replay it
        out: list[Outgoing] = []
        while self.next_tick_at <= now:
            self.tick += 1
            opened_at = self.next_tick_at
            for p in due_fragments(self.tick, len(self.fragments), self.cfg.sync_every):
                live = self.live(now)
                if p in self.rounds or not live or p not in self.owned:
                    continue  # the previous round of p is still open, or nobody to ask
                rnd = self._open(p, opened_at)
                out += [FragmentRequest(m, p, rnd.round_id) for m in live]
            self.next_tick_at += t_step
        return out

    def outer_lr(self) -> float:
        """The outer LR now: constant, or a cosine over the merged tokens (outer_lr_decay_tokens)."""
        total = self.cfg.outer_lr_decay_tokens
        if total <= 0:
            return self.cfg.outer_lr
        frac = min(1.0, self.global_tokens / total)
        return self.cfg.outer_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    def effective_quorum(self, rnd: Round, now: float) -> int:
        """K_eff = min(K, live learners that were asked); K = "all" means all of them."""
        live_asked = len(rnd.asked & set(self.live(now)))
        k = self.cfg.quorum_size
        return live_asked if k is None else min(k, live_asked)

    def grace_window(self, t_quorum: float, now: float) -> float:
        """grace = clamp(gamma*(tau*t_step - t_quorum - t_sync), 0, max_grace_steps*t_step)."""
        t_step = self.t_step(now) or 0.0
        raw = self.cfg.grace_gamma * (self.cfg.overlap * t_step - t_quorum - self._t_sync.get())
        return min(max(raw, 0.0), self.cfg.max_grace_steps * t_step)

    def _close_reason(self, rnd: Round, now: float) -> str | None:
        answered = set(rnd.pending)
        live_asked = rnd.asked & set(self.live(now))
        k_eff = self.effective_quorum(rnd, now)
        if not answered:
            return "no_live_learners" if not live_asked and now > rnd.opened_at else None
        if len(answered) < max(k_eff, 1):
            return None
        if rnd.quorum_at is None:
            rnd.quorum_at = sorted(rnd.arrived_at.values())[max(k_eff, 1) - 1]
            t_quorum = rnd.quorum_at - rnd.opened_at
            self._t_quorum.update(t_quorum)
            rnd.grace_s = self.grace_window(t_quorum, now) if self.cfg.grace else 0.0
            rnd.grace_until = rnd.quorum_at + rnd.grace_s
        if live_asked <= answered:
            return "all_answered"
        if not self.cfg.grace:
            return "quorum"
        if rnd.grace_until is not None and now >= rnd.grace_until:
            return "grace_over"
        return None

    def _close(self, rnd: Round, now: float, reason: str) -> list[Outgoing]:
        del self.rounds[rnd.fragment]
        frag = self.fragments[rnd.fragment]
        contribs = [rnd.pending[m] for m in sorted(rnd.pending)]
        weights = [token_weight(c.tokens, c.steps) for c in contribs]
        record = RoundRecord(rnd.fragment, rnd.round_id, rnd.opened_at, now, frag.version, quorum=self.effective_quorum(rnd, now), grace_s=rnd.grace_s, close_reason=reason, rejected=rnd.rejected)
        if contribs and sum(weights) > 0:
            deltas = [rnd.deltas[c.learner] for c in contribs]
            merged = merge_deltas(deltas, weights, self._emb[rnd.fragment], self.cfg.merge)
            frag.outer.lr = self.outer_lr()
            new_values = frag.outer.step(frag.values, merged)
            frag.version += 1
            frag.history.append((frag.version, new_values))
            frag.tokens_merged += sum(c.tokens for c in contribs)
            record.version = frag.version
            self.new_versions.append((rnd.fragment, frag.version))
            pull_s = (rnd.first_answer_at or now) - rnd.opened_at
            self._awaiting_ack[(rnd.fragment, frag.version)] = (now, pull_s)
        for c, w in zip(contribs, weights):
            self.learners[c.learner].data_position = max(self.learners[c.learner].data_position, c.data_position)
            record.merged.append({
                "learner": c.learner,
                "base_version": c.base_version,
                "staleness": record.version - 1 - c.base_version if record.version > c.base_version else 0,
                "weight": w,
                "tokens": c.tokens,
                "steps": c.steps,
                "in_grace": c.learner in rnd.in_grace,
            })
        self.tape.append(record.to_json())
        # The new version goes to the learners merged in this round; others ask when they need it.
        return [self._update(c.learner, rnd.fragment, "merged", now) for c in contribs]

    def flush(self, now: float) -> list[Outgoing]:
        """Close every open round with what it has (before a final evaluation)."""
        out: list[Outgoing] = []
        for p in sorted(self.rounds):
            rnd = self.rounds[p]
            if rnd.pending:
                out += self._close(rnd, now, "flush")
            else:
                del self.rounds[p]
        return out

    def next_deadline(self, now: float) -> float | None:
        """The next time ``poll`` could change something without a new message."""
        times = []
        if self.cfg.late_fragment == "continue" and self.next_tick_at is not None:
            times.append(self.next_tick_at)
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

    def _update(self, learner: int, p: int, reason: str, now: float) -> FragmentUpdate:
        frag = self.fragments[p]
        return FragmentUpdate(learner, p, frag.version, frag.values, self.global_tokens, max(1, len(self.live(now))), self.max_step_seen, reason)

    def global_state(self) -> dict[str, torch.Tensor]:
        """The global model as a name -> tensor map (row-split pieces joined back)."""
        parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for pieces, frag in zip(self.layout.fragments, self.fragments):
            for pc, v in zip(pieces, frag.values):
                parts.setdefault(pc.name, []).append((pc.row_start, v))
        out = {}
        for name, chunks in parts.items():
            chunks.sort(key=lambda x: x[0])
            out[name] = chunks[0][1].clone() if len(chunks) == 1 else torch.cat([v for _, v in chunks])
        return out

    def versions(self) -> list[int]:
        return [f.version for f in self.fragments]

    # -- durable state (the runtime decides where and when to write it) ----------------------

    def fragment_state(self, p: int) -> tuple[dict[str, torch.Tensor], dict]:
        """Fragment p's current values and outer momentum (tensors) plus its counters (JSON)."""
        frag = self.fragments[p]
        tensors = {f"v{i}": v for i, v in enumerate(frag.values)}
        if frag.outer.buffers is not None:
            tensors.update({f"m{i}": b for i, b in enumerate(frag.outer.buffers)})
        return tensors, {"fragment": p, "version": frag.version, "tokens_merged": frag.tokens_merged}

    def load_fragment_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Restore fragment p from ``fragment_state`` output (older versions are not kept:
        contributions based on them are answered with the current value)."""
        p = int(meta["fragment"])
        frag = self.fragments[p]
        n = len(self.layout.fragments[p])
        values = [tensors[f"v{i}"].float().clone() for i in range(n)]
        frag.version = int(meta["version"])
        frag.tokens_merged = int(meta["tokens_merged"])
        frag.history.clear()
        frag.history.append((frag.version, values))
        frag.outer.buffers = [tensors[f"m{i}"].float().clone() for i in range(n)] if "m0" in tensors else None

    def meta_state(self) -> dict:
        """Everything else worth keeping across a restart (JSON-able)."""
        return {
            "tick": self.tick,
            "max_step_seen": self.max_step_seen,
            "round_ids": self._round_ids,
            "data_positions": {str(m): i.data_position for m, i in self.learners.items()},
        }

    def load_meta_state(self, meta: dict) -> None:
        self.tick = int(meta["tick"])
        self.max_step_seen = int(meta["max_step_seen"])
        self._round_ids = int(meta["round_ids"])
        for m, pos in meta["data_positions"].items():
            info = self.learners.setdefault(int(m), LearnerInfo(-math.inf, Ema(self.cfg.ema_decay)))
            info.data_position = int(pos)
