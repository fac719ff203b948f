"""What a contribution must pass before it can touch a round: one pipeline, read top to bottom.

``ADMISSION`` lists the steps in the order they run; each is handed the contribution on its way
(``Admitting``: the contribution, what the syncer knows of its sender and fragment, the fleet's
step time and ``now``, all as values) and returns a refusal (a stable keyword and a line for a
human) or None to pass it on. A step may rely on every step before it: once ``check_identity``
passed, the sender is registered and the fragment is in the layout and owned. Only ``anchor``
changes anything: it turns the payload into its outer gradient, in place (the syncer owns the
tensors it is handed), which the norm checks after it bound. What passes goes to its round
(``Round.accept``); the screening against the round's other answers happens at its close
(``core/round.py``). The weight cap, which bounds any one learner's share of a merge, is here
too. Nothing here writes the syncer's state.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import Piece
from ddiloco.core.merge import make_delta
from ddiloco.core.messages import Contribution
from ddiloco.core.tape import RejectReason
from ddiloco.core.validation import Problem, check_buffers, check_counters, check_norm, check_payload, check_routed
from ddiloco.core.versions import FragmentState

STRIKES: frozenset[RejectReason] = frozenset(
    {
        "bad_counters",
        "bad_payload",
        "bad_norm",
        "bad_buffer",
        "outlier",
        "misaligned",
        "implausible",
        "bad_version",
        "bad_fragment",
    }
)
"""Refusals that count towards quarantine: what the contribution carried was wrong. Arriving
late, twice, from an old base or an old process is what honest learners do too."""


@dataclass(frozen=True)
class Sender:
    """What the syncer knows of a contribution's sender, as values."""

    registered: int | None
    """Its registered incarnation (None: unknown, or it left)."""
    last_seq: int
    """The highest seq accepted from it for the contribution's fragment (-1: none)."""
    quarantine: Mapping[int, int] | None
    """While quarantined: per fragment, the version its answers must start from again."""


@dataclass(frozen=True)
class Shape:
    """What the layout says of the fragments, worked out once by the syncer."""

    pieces: Sequence[Sequence[Piece]]
    """Per fragment, its pieces."""
    buffers: Sequence[Sequence[int]]
    """Per fragment, the positions of its buffer pieces (merged as values, not progress)."""
    numel: Sequence[int]
    """Per fragment, its elements."""
    rows: Mapping[str, int]
    """Rows (dim 0) of each tensor: what routed-token counts must match."""
    owned: Sequence[int]
    """The fragments this syncer shard owns."""


@dataclass
class Admitting:
    """One contribution on its way through ``ADMISSION``: what the steps judge it with, and what
    the steps it passed found out."""

    c: Contribution
    """The contribution (its tensors become its outer gradient in ``anchor``)."""
    sender: Sender
    """What the syncer knows of who sent it."""
    fragments: Sequence[FragmentState]
    """The syncer's fragments (read only)."""
    shape: Shape
    """What the layout says of them."""
    t_step: float | None
    """The fleet's step time now (None: none known yet)."""
    now: float
    """The time the syncer was handed with it."""
    cfg: DiLoCoConfig
    """The algorithm's settings."""
    base: list[torch.Tensor] = field(default_factory=list)
    """The values of its base version (``check_base``)."""
    values: list[torch.Tensor] = field(default_factory=list)
    """Its payload; after ``anchor``, its outer gradient (its buffers: their values)."""
    raw: list[torch.Tensor] = field(default_factory=list)
    """Its buffer pieces' values, as sent."""
    norms: list[float] = field(default_factory=list)
    """Per piece, the norm of its outer gradient (0 for a buffer): set by ``anchor``."""

    @property
    def frag(self) -> FragmentState:
        """Its fragment (a step after ``check_identity`` may rely on it existing)."""
        return self.fragments[self.c.fragment]


def check_identity(a: Admitting) -> Problem | None:
    """Who sent it and what it claims to answer: a registered learner, this incarnation, a
    fragment of the layout that this shard owns, not a replay, a base version once issued."""
    c, registered, n = a.c, a.sender.registered, len(a.fragments)
    version = a.fragments[c.fragment].version if 0 <= c.fragment < n else None
    if registered is None:
        return "unknown_learner", f"unknown learner {c.learner}: learners must join before contributing"
    if registered != c.incarnation:
        return "stale_incarnation", (
            f"learner {c.learner} incarnation {c.incarnation} is not the registered {registered}"
        )
    if not 0 <= c.fragment < n or version is None:
        return "bad_fragment", f"unknown fragment {c.fragment} (the layout has {n})"
    if c.fragment not in a.shape.owned:
        return "bad_fragment", f"fragment {c.fragment} is owned by another syncer shard"
    if c.seq <= a.sender.last_seq:
        return "duplicate", f"contribution {tuple(c.identity)} is a replay or older than one already accepted"
    if c.base_version > version or c.base_version < 0:
        return "bad_version", f"base version {c.base_version} was never issued (current {version})"
    return None


def check_claims(a: Admitting) -> Problem | None:
    """Its counters and payload (the shapes of the fragment's pieces), and its routed-token
    counts (each tensor's rows)."""
    c, pieces = a.c, a.shape.pieces[a.c.fragment]
    return check_counters(c.steps, c.tokens, a.cfg) or check_payload(c, pieces) or check_routed(c, pieces, a.shape.rows)


def check_quarantine(a: Admitting) -> Problem | None:
    """A quarantined learner's answers are refused until it answers from the versions it was sent."""
    c, quarantine = a.c, a.sender.quarantine
    if quarantine is None or c.base_version >= quarantine.get(c.fragment, 0):
        return None
    return "quarantined", (
        f"learner {c.learner} is quarantined until it answers from version "
        f"{quarantine.get(c.fragment, 0)} of fragment {c.fragment} (sent to it)"
    )


def check_pace(a: Admitting) -> Problem | None:
    """Steps cannot outrun the time since the learner's base version was made."""
    c, cfg, t_step, now = a.c, a.cfg, a.t_step, a.now
    base_made_at = a.frag.made_at(c.base_version)
    if t_step is None or not math.isfinite(base_made_at):
        return None  # the initial or a restored version: no time reference
    most = (now - base_made_at) / t_step * cfg.max_speedup + cfg.sync_every
    if c.steps > most:
        return "implausible", (
            f"{c.steps} steps since version {c.base_version}, made {now - base_made_at:.1f} s ago: more than "
            f"max_speedup = {cfg.max_speedup:g} x the fleet's step time ({t_step:.3g} s) allows ({most:.0f})"
        )
    return None


def check_base(a: Admitting) -> Problem | None:
    """Its base version is still kept (``stale_base``: the syncer then sends the current one)."""
    c, frag = a.c, a.frag
    held = frag.at(c.base_version)
    if held is not None and not held.full and (c.kind == "values" or a.cfg.anchor != "base"):
        held = None  # a values payload needs its base's parameters: only the current version has them
    if held is None:
        return (
            "stale_base",
            f"stale base version {c.base_version} (current {frag.version}, keeping {a.cfg.keep_versions})",
        )
    a.base = held.values
    return None


def check_statistics(a: Admitting) -> Problem | None:
    """Its buffers (running statistics, counts) against its base (``validation.check_buffers``):
    a delta payload carries its statistics as values too."""
    c, buffers = a.c, a.shape.buffers[a.c.fragment]
    a.values = list(c.values)
    if not buffers:
        return None
    pieces = a.shape.pieces[c.fragment]
    a.raw = [c.values[i] for i in buffers]
    return check_buffers(a.raw, [a.base[i] for i in buffers], [pieces[i] for i in buffers], c.steps, a.cfg)


def anchor(a: Admitting) -> Problem | None:
    """The payload becomes its outer gradient in place, against its own base version (or the
    current one, ``anchor = "current"``, an ablation). The fragment only changes when its round
    closes, so the anchor chosen now is the one the merge would use at the close. Never refuses."""
    c, buffers = a.c, a.shape.buffers[a.c.fragment]
    against: list[torch.Tensor] | None = a.base if a.cfg.anchor == "base" else a.frag.values
    if c.kind == "delta":
        if a.cfg.anchor == "base":
            against = None  # the payload already is the outer gradient against its base
        else:  # rebase a delta on the current version (an ablation): rebuild the values
            a.values = [b - d for b, d in zip(a.base, c.values)]
    anchors: list[torch.Tensor | None] = [None] * len(a.values) if against is None else list(against)
    for i, v in zip(buffers, a.raw):
        a.values[i], anchors[i] = v, None  # kept as values, norm 0: statistics, not progress
    a.norms = [make_delta(t, v) if i not in buffers else 0.0 for i, (t, v) in enumerate(zip(anchors, a.values))]
    return None


def check_bounded(a: Admitting) -> Problem | None:
    """Its outer gradient is finite and within ``max_delta_norm`` (``validation.check_norm``)."""
    return check_norm(a.norms, a.cfg)


def check_relative_norm(a: Admitting) -> Problem | None:
    """The outer gradient is bounded relative to its fragment (screening against its peers
    happens when the round closes, when they are known)."""
    cfg, fragment_norm, numel = a.cfg, a.frag.norm, a.shape.numel[a.c.fragment]
    norm = math.sqrt(sum(n * n for n in a.norms))
    bound = cfg.max_delta_ratio * fragment_norm + cfg.max_delta_floor * math.sqrt(numel)
    if norm > bound:
        return "bad_norm", (
            f"outer-gradient norm {norm:.3g} exceeds {cfg.max_delta_ratio:g} x the fragment's "
            f"{fragment_norm:.3g} + {cfg.max_delta_floor:g} x sqrt({numel}) = {bound:.3g}"
        )
    return None


ADMISSION: tuple[Callable[[Admitting], Problem | None], ...] = (
    check_identity,
    check_claims,
    check_quarantine,
    check_pace,
    check_base,
    check_statistics,
    anchor,
    check_bounded,
    check_relative_norm,
)
"""Every step a contribution passes before it enters a round, in order: nothing before
``anchor`` touches its tensors, nothing after it is handed anything new."""


def admit(a: Admitting) -> Problem | None:
    """Run ``a`` through ``ADMISSION``: the first refusal, or None (``a.values`` and ``a.norms``
    then hold its outer gradient)."""
    for step in ADMISSION:
        problem = step(a)
        if problem is not None:
            return problem
    return None


def weight_cap(recent_weights: Iterable[Sequence[float]], cfg: DiLoCoConfig) -> float | None:
    """weight_cap x the fleet's typical weight (None: no weights yet, or disabled), from each
    live learner's recent accepted weights (one sequence per learner).

    The typical weight is the lower median over learners of each one's own median: one vote
    per learner, so with a majority of honest learners it is an honest learner's weight,
    whatever one learner claims, high or low. Before, the median of all recent weights
    pooled let a learner whose clipped weights were recorded at the cap lift it round after
    round (with one honest peer: a 0.92 share in 12 s). With two learners there is no
    majority: the cap follows the lower of the two (neither can rise above weight_cap x the
    other). A share cap would fire on every honest round with one contributor."""
    if cfg.weight_cap <= 0:
        return None
    # Only positive weights are kept: a zero-step answer says nothing of a learner's pace,
    # and a median of zeros would clip every later contribution to nothing.
    medians = [statistics.median(ws) for ws in recent_weights if ws]
    return cfg.weight_cap * statistics.median_low(medians) if medians else None
