"""What a contribution must pass before it can touch a round, and the screening at its close.

Admission happens on arrival: who sent it (registered, this incarnation, not a replay), what it
claims (fragment, base version, counters, payload; ``validation.py``), whether its steps fit the
time since its base version, and whether its outer gradient is bounded relative to its fragment.
Screening happens when the round closes, when the round's other answers are known: an answer
that moves much more per step than its peers and the fragment's recent history is taken out.
The weight cap bounds any one learner's share of a merge. Every function here is pure: it is
handed what it judges and returns a refusal (a stable keyword and a line for a human) or None.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import Piece
from ddiloco.core.messages import Contribution
from ddiloco.core.tape import RejectReason
from ddiloco.core.validation import Problem, check_counters, check_payload, check_routed

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

SCREEN_ROUNDS = 3
"""Merged rounds (with steps) a fragment needs before its history is a screening reference."""


def check_identity(
    c: Contribution,
    registered: int | None,
    last_seq: int,
    owned: Sequence[int],
    num_fragments: int,
    version: int | None,
) -> Problem | None:
    """Who sent it and what it claims to answer: ``registered`` is the learner's registered
    incarnation (None: unknown or left), ``last_seq`` the highest seq accepted from it for this
    fragment (-1: none), ``version`` the fragment's current version (None: not in the layout)."""
    if registered is None:
        return "unknown_learner", f"unknown learner {c.learner}: learners must join before contributing"
    if registered != c.incarnation:
        return "stale_incarnation", (
            f"learner {c.learner} incarnation {c.incarnation} is not the registered {registered}"
        )
    if not 0 <= c.fragment < num_fragments or version is None:
        return "bad_fragment", f"unknown fragment {c.fragment} (the layout has {num_fragments})"
    if c.fragment not in owned:
        return "bad_fragment", f"fragment {c.fragment} is owned by another syncer shard"
    if c.seq <= last_seq:
        return "duplicate", f"contribution {tuple(c.identity)} is a replay or older than one already accepted"
    if c.base_version > version or c.base_version < 0:
        return "bad_version", f"base version {c.base_version} was never issued (current {version})"
    return None


def check_claims(
    c: Contribution, pieces: Sequence[Piece], cfg: DiLoCoConfig, rows: Mapping[str, int] | None = None
) -> Problem | None:
    """Its counters and payload (the shapes of the fragment's pieces), and its routed-token
    counts (``rows``: each tensor's rows; without it, no counts are accepted)."""
    return check_counters(c.steps, c.tokens, cfg) or check_payload(c, pieces) or check_routed(c, pieces, rows or {})


def check_quarantine(c: Contribution, quarantine: Mapping[int, int] | None) -> Problem | None:
    """A quarantined learner's answers are refused until it answers from the versions it was sent."""
    if quarantine is None or c.base_version >= quarantine.get(c.fragment, 0):
        return None
    return "quarantined", (
        f"learner {c.learner} is quarantined until it answers from version "
        f"{quarantine.get(c.fragment, 0)} of fragment {c.fragment} (sent to it)"
    )


def check_pace(
    c: Contribution, base_made_at: float, now: float, t_step: float | None, cfg: DiLoCoConfig
) -> Problem | None:
    """Steps cannot outrun the time since the learner's base version was made."""
    if t_step is None or not math.isfinite(base_made_at):
        return None  # the initial or a restored version: no time reference
    most = (now - base_made_at) / t_step * cfg.max_speedup + cfg.sync_every
    if c.steps > most:
        return "implausible", (
            f"{c.steps} steps since version {c.base_version}, made {now - base_made_at:.1f} s ago: more than "
            f"max_speedup = {cfg.max_speedup:g} x the fleet's step time ({t_step:.3g} s) allows ({most:.0f})"
        )
    return None


def check_relative_norm(norms: Sequence[float], fragment_norm: float, numel: int, cfg: DiLoCoConfig) -> Problem | None:
    """The outer gradient is bounded relative to its fragment (screening against its peers
    happens when the round closes, when they are known)."""
    norm = math.sqrt(sum(n * n for n in norms))
    bound = cfg.max_delta_ratio * fragment_norm + cfg.max_delta_floor * math.sqrt(numel)
    if norm > bound:
        return "bad_norm", (
            f"outer-gradient norm {norm:.3g} exceeds {cfg.max_delta_ratio:g} x the fragment's "
            f"{fragment_norm:.3g} + {cfg.max_delta_floor:g} x sqrt({numel}) = {bound:.3g}"
        )
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


def misaligned_detail(cosine: float, alignment: float, cfg: DiLoCoConfig) -> str:
    return (
        f"direction: cosine {cosine:.3g} with the round's centre is {alignment:.3g} x the round's median "
        f"cosine, below algo.robust_min_alignment = {cfg.robust_min_alignment:g}"
    )


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


def outlier_detail(x: float, ref: float, cfg: DiLoCoConfig) -> str:
    return (
        f"|delta| per step = {x:.3g} exceeds {cfg.norm_screen_factor:g} x its reference {ref:.3g} "
        "(the fragment's recent answers and this round's others)"
    )
