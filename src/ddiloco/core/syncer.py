"""The syncer as a state machine: handed events and the time, it returns what the driver must do.

It holds the global fragments, their recent versions and outer-optimizer state, opens rounds on
a step clock (or when a lock-step learner pushes), decides quorum and grace from ``now``, merges
with token weights and takes the outer step. Every call returns an ``Output``: messages to
send, fragments whose new version must be made durable *before* those messages leave, and the
records of the event tape. It never reads a clock, sleeps, does I/O or keeps the tape; what it
does keep is bounded by the number of learners and fragments.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ddiloco.core import admission, robust
from ddiloco.core.admission import STRIKES, screened
from ddiloco.core.codec import Chain
from ddiloco.core.compress import is_lossy
from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.ema import Ema
from ddiloco.core.fragments import (
    FragmentLayout,
    assemble,
    due_fragments,
    read_fragment,
    storage_bytes,
    take_fragment,
    tensor_rows,
)
from ddiloco.core.merge import Accumulator, RowAccumulator, make_delta, row_factors, token_weight
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
from ddiloco.core.tape import (
    MAX_REJECTIONS_PER_ROUND,
    CloseReason,
    Late,
    MergedEntry,
    Rejection,
    RejectReason,
    RoundRecord,
    TapeRecord,
)
from ddiloco.core.validation import check_buffers, check_norm

STEP_CONSENSUS = 4.0
"""Step-time EMAs more than this factor from the live fleet's lower median do not drive the
step clock (honest fleets differ by less; ``max_speedup`` bounds claims at 8x)."""


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


@dataclass(frozen=True)
class FragmentRecord:
    """One fragment's durable state: what a restart needs to continue exactly where it was."""

    fragment: int
    """Fragment index."""
    version: int
    """Its version."""
    tokens_merged: int
    """Tokens merged into it so far."""
    values: list[torch.Tensor]
    """Its global values, one tensor per piece."""
    momentum: list[torch.Tensor] | None
    """The outer optimizer's momentum buffers (None before the first outer step)."""


@dataclass(frozen=True)
class JoinRefusal:
    """A join the syncer will not take."""

    learner: int
    """Who asked."""
    reason: str
    """Why, for a human."""
    retry_after_s: float
    """> 0: a passing condition (the id's holder may be gone soon): try again after this long;
    0: final (the learner must not retry)."""


@dataclass
class LearnerInfo:
    """What the syncer knows of one learner id."""

    incarnation: int
    """The registered process incarnation; messages of any other are not accepted."""
    last_heard: float
    """When the learner was last heard from (the core's time)."""
    step_time: Ema
    """EMA of its reported inner-step duration."""
    left: bool = False
    """Whether it left cleanly (not live until it joins again)."""
    data_position: int = 0
    """Batches of its shard consumed, as of its last merged contribution."""
    last_seq: dict[int, int] = field(default_factory=dict)
    """Per fragment, the highest sequence number accepted from this incarnation."""
    recent_weights: deque[float] = field(default_factory=lambda: deque(maxlen=8))
    """Token weights of its last accepted contributions (after clipping)."""
    strikes: int = 0
    """Contributions refused in a row for what they carried (not for arriving late or twice)."""
    quarantine: dict[int, int] | None = None
    """While quarantined: per fragment, the version its answers must start from again."""
    last_contribution_at: float = -math.inf
    """When its last contribution was accepted into a round (-inf: none yet)."""
    held: dict[int, int] = field(default_factory=dict)
    """Per owned fragment, the newest version it is known to hold (its join, acks, answers)."""
    trust: float = 1.0
    """The robust merge's trust in this id: an average of its answers' alignments over rounds.
    Kept across incarnations and restarts: re-registering does not reset it."""
    stale_served: dict[int, int] = field(default_factory=dict)
    """Per fragment, the version last sent in answer to a stale contribution (at most once each)."""


@dataclass(frozen=True)
class LearnerView:
    """One learner id as the syncer's core sees it (read-only)."""

    learner: int
    """Learner id."""
    incarnation: int
    """Its registered incarnation."""
    state: str
    """"up" (heard within the liveness timeout), "left" (said goodbye) or "down"."""
    last_heard: float
    """When it was last heard (core time)."""
    step_time_s: float | None
    """Its step-time EMA (None: none reported yet)."""
    last_contribution_at: float
    """When its last contribution was accepted into a round (-inf: none yet)."""
    held: tuple[tuple[int, int], ...]
    """(fragment, version) of each owned fragment it is known to hold."""


@dataclass(frozen=True)
class FragmentView:
    """One owned fragment as the syncer's core sees it (read-only)."""

    fragment: int
    """Fragment index."""
    version: int
    """Its current version."""
    made_at: float
    """When that version was made (-inf: the initial or a restored one)."""
    merged: int
    """Learners merged with a positive weight in its last merge."""
    grace_s: float
    """The grace window of its last merged round."""
    tokens_merged: int
    """Tokens merged into it so far."""
    open: bool
    """Whether a round of it is open."""


@dataclass(frozen=True)
class SyncerView:
    """What a driver may read of the syncer's core: the fleet and the owned fragments."""

    live: tuple[int, ...]
    """Live learners, sorted."""
    learners: tuple[LearnerView, ...]
    """Every registered learner id, sorted."""
    fragments: tuple[FragmentView, ...]
    """Every owned fragment, in order."""
    merged_tokens: float
    """Tokens merged into the global model (the mean over the owned fragments)."""
    learners_total: int = 0
    """Every registered learner id (``learners`` may list fewer)."""


@dataclass
class Version:
    """One version of a fragment the syncer still accepts contributions on."""

    number: int
    """The version (0 = the initial values)."""
    values: list[torch.Tensor]
    """Its values. Past versions keep only their buffer pieces (empty tensors stand for the
    parameters) unless the run anchors on the current version (``anchor = "current"``, an
    ablation): learners send deltas against their own base copy, so a parameter's past value
    is never needed, and keeping S of them would cost S times the model."""
    made_at: float
    """When it was made (-inf: the initial or a restored version)."""
    full: bool = True
    """Whether ``values`` holds the parameters too."""


@dataclass
class FragmentState:
    """Global values of one fragment, its recent versions and its outer optimizer."""

    version: int
    """Current version (0 = the initial values)."""
    history: deque[Version]
    """Its recent versions, newest last, at most keep_versions + 1 long (the current one full)."""
    outer: OuterNesterov
    """This fragment's outer optimizer."""
    tokens_merged: int = 0
    """Tokens merged into this fragment so far."""
    norm: float = 0.0
    """|Theta_p| of the current version (bounds the outer gradients against it)."""
    recent_norms: deque[float] = field(default_factory=lambda: deque(maxlen=32))
    """|delta| per step of its recent merged contributions (the robust screening's history)."""
    screen_rounds: int = 0
    """Merged rounds with steps so far (the history becomes a reference after admission.SCREEN_ROUNDS)."""
    last_merged: int = 0
    """Learners merged with a positive weight in its last merge (fleet view only)."""
    last_grace_s: float = 0.0
    """The grace window of its last merged round (seconds)."""
    chain: Chain | None = None
    """The down-link chain (a lossy ``down_encoding`` only): what learners on it hold."""

    @property
    def values(self) -> list[torch.Tensor]:
        return self.history[-1].values

    def at(self, version: int) -> Version | None:
        """``version`` if it is still accepted as a base (None: too old, or never made)."""
        for v in self.history:
            if v.number == version:
                return v
        return None

    def made_at(self, version: int) -> float:
        """When ``version`` was made (-inf when unknown: the initial or a restored version)."""
        v = self.at(version)
        return v.made_at if v is not None else -math.inf

    def push(self, version: Version, keep_past_values: bool, buffers: Sequence[int]) -> None:
        """Make ``version`` the current one; the one before keeps only its buffer pieces unless
        ``keep_past_values``."""
        if self.history and not keep_past_values:
            last = self.history[-1]
            if last.full:
                kept = set(buffers)
                last.values = [v if i in kept else _GONE for i, v in enumerate(last.values)]
                last.full = False
        self.history.append(version)


_GONE = torch.empty(0)
"""What a past version holds in place of a parameter piece it no longer keeps."""


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
    claimed: float = 0.0
    """Its weight as its counters claim it, after the fleet's weight cap, before the robust
    merge's judgement: what the weight cap's reference records (the judgement is not pace)."""
    factors: list[torch.Tensor | None] = field(default_factory=list)
    """Per piece, each row's share of ``weight`` from its routed-token counts (``row_factors``;
    None: no counts for the piece); empty when it sent none or they are not used."""


def _norm(values: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float(torch.linalg.vector_norm(v)) ** 2 for v in values))


def _anchors(anchor: list[torch.Tensor] | None, n: int) -> list[torch.Tensor | None]:
    """Per piece, the tensor a payload is measured against (None: the payload is the delta)."""
    return [None] * n if anchor is None else list(anchor)


@dataclass
class Round:
    """One open round of one fragment."""

    round_id: int
    fragment: int
    opened_at: float
    asked: set[int]
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


def _tokens(pd: Pending) -> int:
    """The tokens a contribution brings to the global count: clipped with its weight
    (w = tokens^2/steps), so a clipped learner cannot inflate the count that drives every
    learner's LR schedule either."""
    c = pd.contribution
    return c.tokens if not pd.clipped else int(math.sqrt(pd.weight * c.steps))


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
    ) -> None:
        """``take``: ``initial``'s tensors are the syncer's to keep (a driver that built the
        model for this and lets it go): fp32 fragments are views of them, not copies."""
        self.cfg = cfg
        self.layout = layout
        # Rows (dim 0) of each tensor: what routed-token counts must match (``expert_weights``).
        self._rows = tensor_rows(layout)
        # A syncer shard owns a subset of the fragments; the others' rounds run elsewhere.
        self.owned = sorted(owned) if owned is not None else list(range(layout.num_fragments))
        self.fragments: list[FragmentState] = []
        for pieces in layout.fragments:
            vals = [v.float() for v in (take_fragment if take else read_fragment)(initial, pieces)]
            history = deque([Version(0, vals, -math.inf)], maxlen=cfg.keep_versions + 1)
            outer = OuterNesterov(cfg.outer_lr, cfg.outer_momentum, delayed=cfg.staleness == "delayed")
            frag = FragmentState(0, history, outer, norm=_norm(vals))
            if is_lossy(cfg.down_encoding):
                frag.chain = Chain(0, vals, start=0)
            self.fragments.append(frag)
        flat = list(embedding_like)
        if len(flat) != sum(len(f) for f in layout.fragments):
            raise ValueError("embedding_like needs one flag per piece of the layout")
        self._emb: list[list[bool]] = []
        for pieces in layout.fragments:
            self._emb.append(flat[: len(pieces)])
            flat = flat[len(pieces) :]
        # Per fragment, the positions of its buffer pieces (merged by their own rule, _close).
        self._buffers: list[list[int]] = [
            [i for i, pc in enumerate(pieces) if pc.kind != "param"] for pieces in layout.fragments
        ]
        self._numel = layout.sizes()
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
            # keeps its local progress on it; everything else is sent.
            if have is None or have[p] != self.fragments[p].version:
                out.messages.append(self._update(j.learner, p, "join", now))

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
        """Validate, anchor and queue a contribution; a lock-step push may open a round."""
        problem = self._admission(c, now)
        if problem is not None:
            self._reject(c, *problem, now, out)
            return
        frag = self.fragments[c.fragment]
        held = frag.at(c.base_version)
        if held is not None and not held.full and (c.kind == "values" or self.cfg.anchor != "base"):
            held = None  # a values payload needs its base's parameters: only the current version has them
        if held is None:
            detail = f"stale base version {c.base_version} (current {frag.version}, keeping {self.cfg.keep_versions})"
            self._reject(c, "stale_base", detail, now, out)
            # Send the current value so the learner rebases instead of retrying forever; once
            # per version, so stale answers cannot turn the syncer into an amplifier.
            info = self.learners[c.learner]
            if info.stale_served.get(c.fragment) != frag.version:
                info.stale_served[c.fragment] = frag.version
                out.messages.append(self._update(c.learner, c.fragment, "stale", now))
            return
        base = held.values
        # The fragment only changes when its round closes, so the anchor chosen now is the one
        # the merge would use at the close. The payload becomes the delta in place: the syncer
        # takes ownership of the tensors it is handed.
        values = list(c.values)
        buffers, raw = self._buffers[c.fragment], []
        if buffers:  # statistics are merged as values, checked against the base
            pieces = self.layout.fragments[c.fragment]
            raw = [c.values[i] for i in buffers]  # a delta payload carries its statistics as values too
            problem = check_buffers(raw, [base[i] for i in buffers], [pieces[i] for i in buffers], c.steps, self.cfg)
            if problem is not None:
                self._reject(c, *problem, now, out)
                return
        anchor: list[torch.Tensor] | None = base if self.cfg.anchor == "base" else frag.values
        if c.kind == "delta":
            if self.cfg.anchor == "base":
                anchor = None  # the payload already is the outer gradient against its base
            else:  # rebase a delta on the current version (an ablation): rebuild the values
                values = [b - d for b, d in zip(base, c.values)]
        anchors = _anchors(anchor, len(values))
        for i, v in zip(buffers, raw):
            values[i], anchors[i] = v, None  # kept as values, norm 0: statistics, not progress
        norms = [make_delta(a, v) if i not in buffers else 0.0 for i, (a, v) in enumerate(zip(anchors, values))]
        problem = check_norm(norms, self.cfg) or admission.check_relative_norm(
            norms, frag.norm, self._numel[c.fragment], self.cfg
        )
        if problem is not None:
            self._reject(c, *problem, now, out)
            return
        info = self.learners[c.learner]
        info.last_heard = info.last_contribution_at = now
        info.held[c.fragment] = max(info.held.get(c.fragment, 0), c.base_version)
        self.max_step_seen = max(self.max_step_seen, c.step)
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
                return
            rnd = self._open(c.fragment, now)  # lock-step learners push on their own schedule
        info.last_seq[c.fragment] = c.seq
        info.strikes = 0
        info.quarantine = None  # it answered from a fresh version: it has re-synced
        old = rnd.pending.get(c.learner)
        if old is not None and not any(rnd.per_row):  # a newer answer replaces the older one: take it back out
            self._feed(rnd, old, sign=-1.0)
        weight, cap, clipped = token_weight(c.tokens, c.steps), self.weight_cap(now), False
        if cap is not None and weight > cap:
            weight, clipped = cap, True
        scale = 1.0 / (1 + frag.version - c.base_version) if self.cfg.staleness == "scaled" else 1.0
        # Its counters only: the tensors live on as ``values`` (its outer gradient, in place) and
        # the encoded payload, decoded, is no longer needed.
        meta = dataclasses.replace(c, values=[], encoded=[])
        pending = rnd.pending[c.learner] = Pending(meta, values, norms, weight, now, clipped, scale, claimed=weight)
        if self.cfg.expert_weights == "routed" and c.routed and c.tokens > 0:
            pieces = self.layout.fragments[c.fragment]
            pending.factors = [
                row_factors(r, pc.row_start, pc.row_end) if r else None for r, pc in zip(c.routed, pieces)
            ]
        rnd.refused.discard(c.learner)
        if (old is not None and any(rnd.per_row)) or self._per_row(rnd) != rnd.per_row:
            self._rebuild(rnd)  # rows weighed apart start or stop: every answer goes in again
        else:
            self._feed(rnd, pending)
        if rnd.quorum_at is not None:
            rnd.in_grace.add(c.learner)  # admitted after the quorum was reached
        if rnd.first_answer_at is None:
            rnd.first_answer_at = now

    def weight_cap(self, now: float) -> float | None:
        """The cap on one contribution's weight now (``admission.weight_cap`` over the live
        learners' recent accepted weights)."""
        return admission.weight_cap((list(self.learners[m].recent_weights) for m in self.live(now)), self.cfg)

    def _admission(self, c: Contribution, now: float) -> tuple[RejectReason, str] | None:
        """Why ``c`` may not enter a round before its payload is touched (``core/admission.py``)."""
        info = self.learners.get(c.learner)
        registered = None if info is None or info.left else info.incarnation
        p = c.fragment
        frag = self.fragments[p] if 0 <= p < len(self.fragments) else None
        last_seq = info.last_seq.get(p, -1) if info is not None else -1
        version = frag.version if frag is not None else None
        problem = admission.check_identity(c, registered, last_seq, self.owned, len(self.fragments), version)
        if problem is not None or info is None or frag is None:
            return problem
        return (
            admission.check_claims(c, self.layout.fragments[p], self.cfg, self._rows)
            or admission.check_quarantine(c, info.quarantine)
            or admission.check_pace(c, frag.made_at(c.base_version), now, self.t_step(now), self.cfg)
        )

    def _reject(self, c: Contribution, reason: RejectReason, detail: str, now: float, out: Output) -> None:
        r = Rejection(c.learner, c.fragment, reason, detail, now)
        rnd = self.rounds.get(c.fragment)
        if rnd is None:
            out.tape.append(r)
        else:
            rnd.rejected_total += 1
            if c.learner not in rnd.pending:
                rnd.refused.add(c.learner)
            if len(rnd.rejected) < MAX_REJECTIONS_PER_ROUND:
                rnd.rejected.append(r)
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
        timeout = self.cfg.liveness_timeout_s
        return sorted(m for m, i in self.learners.items() if not i.left and now - i.last_heard <= timeout)

    def t_step(self, now: float) -> float | None:
        """Median over live learners of their step-time EMAs (None before any is known), over
        those within ``STEP_CONSENSUS`` x of the fleet's lower median: half of the live
        learners reporting the largest allowed step time cannot stop the clock."""
        times = [self.learners[m].step_time.value for m in self.live(now)]
        known = [t for t in times if t]
        if not known:
            return None
        low = statistics.median_low(known)
        return statistics.median(t for t in known if low / STEP_CONSENSUS <= t <= low * STEP_CONSENSUS)

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
        frag = self.fragments[p]
        flat = self._scratch_pool.pop() if self._scratch_pool else torch.empty(self._scratch_numel)
        scratch, at = [], 0
        for v in frag.values:
            scratch.append(flat[at : at + v.numel()].view(v.shape))
            at += v.numel()
        rda = [
            self.cfg.merge == "rda" and not emb and pc.kind == "param"
            for pc, emb in zip(self.layout.fragments[p], self._emb[p])
        ]
        merge: list[Accumulator | RowAccumulator] = [Accumulator(t, rda=r) for t, r in zip(scratch, rda)]
        rnd = Round(self._round_ids, p, now, set(self.live(now)), merge=merge, scratch=flat, per_row=[False] * len(rda))
        self.rounds[p] = rnd
        return rnd

    def poll(self, now: float) -> Output:
        """Advance the step clock to ``now``, open due rounds, close rounds that may close."""
        out = Output()
        if self.cfg.late_fragment == "continue" and not self.finishing:
            self._advance_clock(now, out)
        for p in sorted(self.rounds):
            rnd = self.rounds[p]
            reason = self._close_reason(rnd, now)
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
        live_asked = len(rnd.asked & set(self.live(now)))
        k = self.cfg.quorum_size
        return live_asked if k is None or rnd.final else min(k, live_asked)

    def grace_window(self, t_quorum: float, now: float) -> float:
        """grace = clamp(gamma*(tau*t_step - t_quorum - t_sync), 0, max_grace_steps*t_step)."""
        t_step = self.t_step(now) or 0.0
        raw = self.cfg.grace_gamma * (self.cfg.overlap * t_step - t_quorum - self._t_sync.get())
        return min(max(raw, 0.0), self.cfg.max_grace_steps * t_step)

    def _close_reason(self, rnd: Round, now: float) -> CloseReason | None:
        answered = set(rnd.pending)
        live_asked = rnd.asked & set(self.live(now))
        done = answered | rnd.refused  # a refused learner has answered too: no round waits for it
        k_eff = self.effective_quorum(rnd, now)
        if not answered:
            if live_asked and live_asked <= done:
                return "all_answered"  # every answer was refused: close, merging nothing
            return "no_live_learners" if not live_asked and now > rnd.opened_at else None
        if len(answered) < max(k_eff, 1):
            return None
        if rnd.quorum_at is None and not (rnd.final or rnd.late):  # no quorum to learn the grace from
            rnd.quorum_at = sorted(pd.arrived_at for pd in rnd.pending.values())[max(k_eff, 1) - 1]
            t_quorum = rnd.quorum_at - rnd.opened_at
            self._t_quorum.update(t_quorum)
            rnd.grace_s = self.grace_window(t_quorum, now) if self.cfg.grace else 0.0
            rnd.grace_until = rnd.quorum_at + rnd.grace_s
        if live_asked <= done:
            return "final" if rnd.final else "all_answered"
        if rnd.final:
            return None  # the final sync waits for every live learner (or its liveness timeout)
        if self.cfg.robust and not rnd.late and len(answered) < min(robust.MIN_ANSWERS, len(live_asked)):
            # The robust merge judges directions against a majority: a round waits for one (up
            # to one period of H steps, by when every live learner has had its chance to answer).
            t_step = self.t_step(now)
            if t_step is not None and now < rnd.opened_at + self.cfg.sync_every * t_step:
                return None
        if not self.cfg.grace:
            return "quorum"
        if rnd.grace_until is not None and now >= rnd.grace_until:
            return "grace_over"
        return None

    def _screen_round(self, rnd: Round, now: float, out: Output) -> None:
        """Take the answers ``admission.out_of_line`` finds out of the round, each refused with
        a strike, and rebuild the merge without them (``_judge_round`` when robust)."""
        frag = self.fragments[rnd.fragment]
        if self.cfg.robust:
            self._judge_round(rnd, now, out)
            return
        stats = {
            m: screened(pd.norms, pd.contribution.steps) for m, pd in rnd.pending.items() if pd.contribution.steps > 0
        }
        found = admission.out_of_line(stats, list(frag.recent_norms), frag.screen_rounds, self.cfg)
        if not found:
            return
        for m, x, ref in found:  # recorded with the round, each with a strike
            c = rnd.pending.pop(m).contribution
            self._reject(c, "outlier", admission.outlier_detail(x, ref, self.cfg), now, out)
        self._rebuild(rnd)

    def _judge_round(self, rnd: Round, now: float, out: Output) -> None:
        """The robust merge (``core/robust.py``): refuse misaligned answers, clip oversized
        ones, weigh each learner by its trust; rebuild the merge if anything changed."""
        frag = self.fragments[rnd.fragment]
        judged = {m: pd for m, pd in rnd.pending.items() if pd.contribution.steps > 0}
        if not judged:
            return
        history = admission.history_reference(list(frag.recent_norms), frag.screen_rounds, self.cfg)
        buffers = self._buffers[rnd.fragment]
        changed = self._clip_buffers(rnd, judged, buffers)
        params = [i for i in range(len(self.layout.fragments[rnd.fragment])) if i not in buffers]
        if not params:
            if changed:
                self._rebuild(rnd)
            return
        verdicts = robust.judge(
            {m: [pd.deltas[i] for i in params] for m, pd in judged.items()},
            {m: math.sqrt(sum(n * n for n in pd.norms)) for m, pd in judged.items()},
            {m: pd.contribution.steps for m, pd in judged.items()},
            history,
            self.cfg.robust_clip,
        )
        full_length = statistics.median(pd.contribution.steps for pd in judged.values()) / 2
        # No answer outweighs robust_weight_cap x the round's median (with a majority to take it from).
        weights = [pd.weight for pd in judged.values() if pd.weight > 0]
        weight_cap = None
        if self.cfg.robust_weight_cap > 0 and len(weights) >= robust.MIN_ANSWERS:
            weight_cap = self.cfg.robust_weight_cap * statistics.median(weights)
        for m, v in verdicts.items():
            pd, info, cfg = judged[m], self.learners[m], self.cfg
            # Only full-length answers judge the learner: a few steps are mostly noise.
            full = pd.contribution.steps >= full_length and not math.isnan(v.cosine)
            if full:
                info.trust = robust.trust_after(info.trust, v.alignment, cfg.robust_trust_decay)
            if full and v.alignment < cfg.robust_min_alignment:
                del rnd.pending[m]
                self._reject(
                    pd.contribution, "misaligned", admission.misaligned_detail(v.cosine, v.alignment, cfg), now, out
                )
                changed = True
                continue
            trusted = robust.trust_factor(info.trust, cfg.robust_trust_full)
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
            factor = trusted * aligned
            if factor < 1.0:
                pd.weight *= factor
                pd.clipped = changed = True
        if changed:
            self._rebuild(rnd)

    def _clip_buffers(self, rnd: Round, judged: dict[int, Pending], buffers: Sequence[int]) -> bool:
        """Bounded influence on the buffers: with a majority to measure against, each answer's
        statistic is clipped, coordinate by coordinate, to within ``robust_clip`` x the round's
        median distance from the round's median there. True if one was cut."""
        if not buffers or len(judged) < robust.MIN_ANSWERS or self.cfg.robust_clip <= 0:
            return False
        cut = False
        for i in buffers:
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

    def _per_row(self, rnd: Round) -> list[bool]:
        """The pieces every answer in the round has routed-token counts for (none unless
        ``expert_weights = "routed"``): those are merged row by row."""
        n = len(rnd.merge)
        answers = [pd for pd in rnd.pending.values() if pd.weight > 0]  # the others add nothing
        if self.cfg.expert_weights != "routed" or not answers:
            return [False] * n
        return [all(len(pd.factors) == n and pd.factors[i] is not None for pd in answers) for i in range(n)]

    def _rebuild(self, rnd: Round) -> None:
        """Rebuild the running sums from what remains (exact; a subtraction would leave residue),
        each piece merged as a whole or row by row as the answers now in the round allow."""
        rnd.per_row = self._per_row(rnd)
        rnd.merge = [
            RowAccumulator(acc.acc, acc.rda) if rows else Accumulator(acc.acc, acc.rda)
            for acc, rows in zip(rnd.merge, rnd.per_row)
        ]
        for pd in rnd.pending.values():
            self._feed(rnd, pd)

    def _feed(self, rnd: Round, pd: Pending, sign: float = 1.0) -> None:
        """Add one answer to the round's running merge (sign -1: take it back out). Statistics
        are a plain weighted mean of values: no staleness discount (it would shrink them)."""
        buffers = self._buffers[rnd.fragment]
        for i, (acc, d, n) in enumerate(zip(rnd.merge, pd.deltas, pd.norms)):
            scale = 1.0 if i in buffers else pd.scale
            if isinstance(acc, RowAccumulator):
                acc.add(d, n, pd.weight, sign=sign, scale=scale, factors=pd.factors[i] if pd.factors else None)
            else:
                acc.add(d, n, pd.weight, sign=sign, scale=scale)

    def _close(self, rnd: Round, now: float, reason: CloseReason, out: Output) -> None:
        self._screen_round(rnd, now, out)
        del self.rounds[rnd.fragment]
        frag = self.fragments[rnd.fragment]
        pending = [rnd.pending[m] for m in sorted(rnd.pending)]
        contribs = [pd.contribution for pd in pending]
        weights = [pd.weight for pd in pending]
        record = RoundRecord(
            rnd.fragment,
            rnd.round_id,
            rnd.opened_at,
            now,
            frag.version,
            quorum=self.effective_quorum(rnd, now),
            grace_s=rnd.grace_s,
            close_reason=reason,
            rejected=rnd.rejected,
            rejected_total=rnd.rejected_total,
        )
        if contribs and sum(weights) > 0:
            merged = [acc.result() for acc in rnd.merge]
            # Buffers (running statistics, counts) become the token-weighted mean of the
            # answers' values: no outer step, no momentum (it is fed zeros). Statistics are
            # levels, not progress: changes from stale bases would add up. A count never falls.
            pieces = self.layout.fragments[rnd.fragment]
            stats = {}
            for i in self._buffers[rnd.fragment]:
                stats[i] = merged[i].clone()
                if pieces[i].kind == "count":
                    torch.maximum(stats[i].round_(), frag.values[i], out=stats[i])
                merged[i] = torch.zeros_like(stats[i])
            frag.outer.lr = self.outer_lr()
            frag.version += 1
            # The part of the live fleet this merge stands for (only a delayed outer step uses it).
            share = sum(1 for w in weights if w > 0) / max(1, len(self.live(now))) if frag.outer.delayed else 1.0
            new_values = frag.outer.step(frag.values, merged, share)
            for i, value in stats.items():
                new_values[i] = value
            frag.push(Version(frag.version, new_values, now), self._keep_past_values, self._buffers[rnd.fragment])
            if frag.chain is not None:
                frag.chain.advance(
                    frag.version, new_values, self.layout.fragments[rnd.fragment], self.cfg.down_encoding
                )
            frag.norm = _norm(new_values)
            frag.tokens_merged += sum(_tokens(pd) for pd in pending)
            frag.last_merged, frag.last_grace_s = sum(1 for w in weights if w > 0), rnd.grace_s
            record.version = frag.version
            out.durable.append(rnd.fragment)
            pull_s = (rnd.first_answer_at or now) - rnd.opened_at
            self._awaiting_ack[rnd.fragment] = (frag.version, now, pull_s)
        frag.screen_rounds += any(c.steps > 0 for c in contribs)
        for pd, c, w in zip(pending, contribs, weights):
            info = self.learners[c.learner]
            if c.steps > 0:  # the screening's and the weight cap's references: merged answers only
                frag.recent_norms.append(screened(pd.norms, c.steps))
            if w > 0 and not rnd.final:
                # The final sync's answers carry whatever is left, often a few steps: as the weight
                # cap's reference they would clip the later final rounds' honest answers.
                info.recent_weights.append(pd.claimed)
            info.data_position = max(info.data_position, c.data_position)
            staleness = record.version - 1 - c.base_version if record.version > c.base_version else 0
            record.merged.append(
                MergedEntry(
                    c.learner,
                    c.incarnation,
                    c.seq,
                    c.base_version,
                    staleness,
                    w,
                    _tokens(pd),
                    c.steps,
                    c.learner in rnd.in_grace,
                    pd.clipped,
                    math.sqrt(sum(n * n for n in pd.norms)),
                    pd.shrunk,
                    pd.alignment,
                )
            )
        out.tape.append(record)
        # The new version goes to the learners merged in this round; others ask when they need it.
        out.messages += [self._update(c.learner, rnd.fragment, "merged", now) for c in contribs]
        if frag.chain is not None:
            frag.chain.delta = None  # its messages are made: the messages hold it until they are sent
        self._release(rnd)

    def _release(self, rnd: Round) -> None:
        """Take a closed round's merge buffer back (the outer step is done with it)."""
        if rnd.scratch is not None:
            self._scratch_pool.append(rnd.scratch)
            rnd.scratch, rnd.merge = None, []

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
        down-link, where it is not the values themselves), ``past`` (buffers of past versions),
        ``pending`` (open rounds' outer gradients, one per answer) and ``scratch`` (merge
        buffers, open rounds' and the pool's). docs/runtime.md states the budget."""

        held: dict[str, list[torch.Tensor]] = {
            k: [] for k in ("values", "momentum", "chain", "past", "pending", "scratch")
        }
        for p in self.owned:
            f = self.fragments[p]
            held["values"] += f.values
            held["momentum"] += [*(f.outer.buffers or ()), *(f.outer.pending or ())]
            if f.chain is not None and any(a is not b for a, b in zip(f.chain.served, f.values)):
                held["chain"] += f.chain.served
            held["past"] += [t for v in list(f.history)[:-1] for t in v.values]
        for rnd in self.rounds.values():
            held["pending"] += [t for pd in rnd.pending.values() for t in pd.deltas]
            held["scratch"] += [rnd.scratch] if rnd.scratch is not None else []
        held["scratch"] += self._scratch_pool
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
        frag = self.fragments[p]
        return FragmentRecord(p, frag.version, frag.tokens_merged, frag.values, frag.outer.state_dict()["buffers"])

    def load_fragment_record(self, rec: FragmentRecord, take: bool = False) -> None:
        """Restore a fragment from ``fragment_record`` output (older versions are not kept:
        contributions based on them are answered with the current value). ``take``: the
        record's tensors are the syncer's to keep (a store read them for it), not copied."""
        frag = self.fragments[rec.fragment]
        frag.version = rec.version
        frag.tokens_merged = rec.tokens_merged
        frag.history.clear()
        frag.history.append(
            Version(rec.version, [v.float() if take else v.float().clone() for v in rec.values], -math.inf)
        )
        frag.norm = _norm(frag.values)
        frag.outer.load_state_dict({"buffers": rec.momentum}, take=take)
        if frag.chain is not None:
            # What learners hold of versions served before is not known: deltas chain again only
            # from versions this process serves.
            frag.chain = Chain(rec.version, frag.values, start=rec.version + 1)

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
            "learners": {
                str(m): {
                    "data_position": i.data_position,
                    "incarnation": i.incarnation,
                    "last_seq": {str(p): s for p, s in i.last_seq.items()},
                    "recent_weights": list(i.recent_weights),
                    "trust": i.trust,
                }
                for m, i in self.learners.items()
            },
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
            info.data_position = int(rec["data_position"])
            info.incarnation = int(rec["incarnation"])
            # Replays of contributions merged before the restart stay refused after it.
            info.last_seq = {int(p): int(s) for p, s in rec["last_seq"].items()}
            info.recent_weights.extend(float(w) for w in rec.get("recent_weights", []))
            trust = float(rec.get("trust", 1.0))
            info.trust = min(max(trust, 0.0), 1.0) if math.isfinite(trust) else 0.0
        for p, norms in meta.get("recent_norms", {}).items():
            if int(p) in self.owned:
                self.fragments[int(p)].recent_norms.extend(float(x) for x in norms)
        for p, n in meta.get("screen_rounds", {}).items():
            if int(p) in self.owned:
                self.fragments[int(p)].screen_rounds = int(n)
