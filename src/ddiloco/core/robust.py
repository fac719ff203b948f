"""Robust merging: each answer of a round judged against the round's robust centre.

A learner holding a valid key can send anything its counters and the norm bounds allow. Norms
alone do not see a delta sent backwards, and a per-round bound does not see a small bias sent
every round. So when a round closes with at least ``MIN_ANSWERS`` answers:

- the round's **centre** is the coordinate-wise median of the answers' unit directions
  (Yin et al. 2018; of directions, so one large answer cannot move it): a minority of fewer
  than half of the answers cannot move it far;
- each answer's **alignment** is its cosine with the centre, relative to the round's median
  cosine. Honest answers of one round share the descent direction: on the quality
  benchmark's healthy arm (4 learners, 2,000 answers) their cosines with the centre were 0.48
  to 1 and their alignments 0.78 to 1.25; a reversed delta has a negative one. An answer below
  ``cfg.robust_min_alignment`` (0.5) is refused;
- each answer's **size** is clipped, not refused: |delta| per step at most
  ``cfg.robust_clip`` x the round's median (the centred clipping of Karimireddy et al. 2021,
  around the round's median norm; honest answers measured 0.39 to 1.6 x it). An honest
  learner after a restart (a cold optimizer takes large first steps) is merged at a bounded
  size instead of being refused;
- each learner's **trust** is an exponential average of its alignments over rounds, kept per
  learner id across incarnations and syncer restarts: a learner that is, round after round,
  less aligned than its peers loses weight in proportion, although no single answer crossed
  the bound. Re-registering does not reset it;
- each learner's **drift** is what it pushes the same way round after round beyond the
  centre. One round cannot tell an attacker who stays inside the honest spread and pushes one
  fixed direction ("a little is enough", Baruch et al. 2019) from an honest answer: its
  alignment looks honest. Over rounds the two differ: an honest answer's part off the centre
  is mostly noise that cancels, the attacker's adds up. Per learner and fragment the syncer
  keeps a decayed sum of each answer's part off the centre (its size relative to the round's
  median), folded into ``SKETCH_DIM`` floats by a sign sketch whose signs come from a seed the
  learners do not know (``Drift``). Its consistent part's size, over the round's median of
  those sizes, is the learner's drift: above ``cfg.robust_drift_limit`` it is evidence, and
  its trust falls as on a misaligned answer, until the push stops (off by default).

With fewer answers there is no majority to define a centre: only the clipping against the
fragment's history and the weight cap apply (``tolerance`` says so at start). Every function
here is pure and reads each delta once per chunk.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

MIN_ANSWERS = 3
"""Answers (with steps) a round needs for a centre: with two, neither is the majority."""

CHUNK = 1 << 16
"""Elements per chunk when the centre is computed: the answers' chunks are stacked (answers x
CHUNK floats), so the working set stays small whatever the fragment's size."""

SKETCH_DIM = 1024
"""Floats a learner's drift history keeps per fragment (4 KiB; a fleet of 64 learners over 24
fragments holds 6 MiB). A sign sketch (element j of piece i adds to bucket j mod SKETCH_DIM,
with a sign per element drawn from the syncer's secret seed, the row's sign times the
bucket's) keeps inner products in expectation, with a relative error of about
sqrt(2 / SKETCH_DIM) = 4% on a squared norm. What it misses: a push whose signed folds cancel,
which only a learner knowing the seed can aim at (the seed is sent to no learner, is drawn anew
at each start, and lives in the syncer's memory and flight recording); a push along the centre
(that is the size bound's, ``robust_clip``)."""

DRIFT_ROUNDS = 4
"""Judged answers a learner needs in a fragment before its drift is evidence: with fewer the
consistent part is estimated from too few rounds to tell from noise."""


@dataclass(frozen=True)
class Verdict:
    """How one answer of a round was judged."""

    cosine: float
    """Cosine of its delta with the round's centre."""
    alignment: float
    """Its cosine relative to the round's median cosine (1: as aligned as a typical answer)."""
    room: float
    """Its size bound over its size (|delta| per step): above 1 it fits, inf without a bound."""
    residual: torch.Tensor | None = None
    """The sketch of its part off the centre, at its clipped size over the round's median
    (None: no centre, or no sketch asked for)."""

    @property
    def clip(self) -> float:
        """The factor that brings its delta within the size bound (1: it fits)."""
        return min(1.0, self.room)


class Sketch:
    """The sign sketch of one fragment's vectors (``SKETCH_DIM``): element j of piece i adds
    to bucket j mod dim, signed by its row's sign times its bucket's, both drawn from ``seed``
    and the piece (so a fragment's sketches of every round are comparable)."""

    def __init__(self, seed: int, dim: int = SKETCH_DIM) -> None:
        self.seed, self.dim = seed, dim
        self._buckets: dict[int, torch.Tensor] = {}

    def _signs(self, n: int, *key: int) -> torch.Tensor:
        mixed = self.seed
        for k in key:  # a fixed odd-multiplier mix: the same signs for the same piece every round
            mixed = (mixed * 0x9E3779B97F4A7C15 + k + 1) % (1 << 63)
        g = torch.Generator().manual_seed(mixed)
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.int64).mul_(2).sub_(1).float()

    def held(self) -> list[torch.Tensor]:
        """The tensors it keeps (each piece's bucket signs)."""
        return list(self._buckets.values())

    def fold(self, rows: torch.Tensor, piece: int, start: int) -> torch.Tensor:
        """The sketch of ``rows`` (vectors x elements), the elements starting at element
        ``start`` of ``piece`` (a multiple of ``CHUNK``): vectors x dim. The row signs are
        drawn per ``CHUNK`` of the piece, so a vector folds the same whole or chunk by chunk."""
        n, length = rows.shape
        if piece not in self._buckets:
            self._buckets[piece] = self._signs(self.dim, piece)
        folded = torch.zeros(n, self.dim)
        for offset in range(0, length, CHUNK):
            part = rows[:, offset : offset + CHUNK]
            blocks = -(-part.shape[1] // self.dim)
            if blocks * self.dim != part.shape[1]:
                part = torch.nn.functional.pad(part, (0, blocks * self.dim - part.shape[1]))
            row_signs = self._signs(CHUNK // self.dim, piece, (start + offset) // CHUNK)[:blocks]
            folded += torch.einsum("nbd,b->nd", part.reshape(n, blocks, self.dim), row_signs)
        return folded.mul_(self._buckets[piece])


@dataclass(frozen=True)
class Centre:
    """A round's centre as the answers see it."""

    cosines: dict[int, float]
    """Each answer's cosine with the centre."""
    units: dict[int, torch.Tensor] = field(default_factory=dict)
    """Each answer's unit direction, sketched (empty without a sketch)."""
    centre: torch.Tensor | None = None
    """The centre's unit direction, sketched (None without a sketch)."""


def _median_chunks(
    deltas: Mapping[int, Sequence[torch.Tensor]], norms: Mapping[int, float]
) -> Iterator[tuple[int, int, int, torch.Tensor, torch.Tensor]]:
    """Chunk by chunk: (piece, start, end, the answers' unit directions there (answers x
    chunk, in sorted learner order), the coordinate-wise median of those)."""
    learners = sorted(deltas)
    n = len(learners)
    inv = torch.tensor([1.0 / norms[m] for m in learners]).unsqueeze(1)
    for i in range(len(deltas[learners[0]])):
        numel = deltas[learners[0]][i].numel()
        for s in range(0, numel, CHUNK):
            e = min(s + CHUNK, numel)
            units = torch.stack([deltas[m][i].reshape(-1)[s:e].float() for m in learners]) * inv
            ordered = units.sort(dim=0).values
            # The median of an even count is the mean of the two middle values (symmetric).
            centre = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) * 0.5
            yield i, s, e, units, centre


def centre_of(
    deltas: Mapping[int, Sequence[torch.Tensor]], norms: Mapping[int, float], sketch: Sketch | None = None
) -> Centre:
    """Each answer's cosine with the coordinate-wise median of the answers' unit directions,
    computed chunk by chunk (``deltas``: per learner, its outer gradient's pieces; ``norms``:
    their total L2 norms, all positive); with a ``sketch``, the units and the centre sketched
    in the same pass."""
    learners = sorted(deltas)
    dots = dict.fromkeys(learners, 0.0)
    centre_sq = 0.0
    folded = torch.zeros(len(learners) + 1, sketch.dim) if sketch is not None else None
    for i, s, _, units, centre in _median_chunks(deltas, norms):
        centre_sq += float(centre @ centre)
        for m, d in zip(learners, (units @ centre).tolist()):
            dots[m] += d
        if sketch is not None and folded is not None:
            folded += sketch.fold(torch.cat([units, centre.unsqueeze(0)]), i, s)
    scale = math.sqrt(centre_sq)
    cosines = {m: (dots[m] / scale if scale > 0 else 0.0) for m in learners}
    if folded is None or scale <= 0:
        return Centre(cosines)
    return Centre(cosines, {m: folded[k] for k, m in enumerate(learners)}, folded[-1] / scale)


def judge(
    deltas: Mapping[int, Sequence[torch.Tensor]],
    norms: Mapping[int, float],
    steps: Mapping[int, int],
    history: float | None,
    clip: float,
    sketch: Sketch | None = None,
) -> dict[int, Verdict]:
    """Judge the answers of one round. ``history``: the fragment's reference |delta| per step
    (None: not armed yet); ``clip``: the size bound in multiples of the reference (0: none);
    ``sketch``: the fragment's, to give each verdict its residual.

    The size reference is the round's median |delta| per step when the round has a centre
    (``MIN_ANSWERS``), else the history's. Alignment is only judged with a centre whose median
    cosine is positive; otherwise every alignment is 1. An answer's residual is its unit
    direction's part off the centre, times its clipped |delta| per step over the reference."""
    per_step = {m: norms[m] / max(steps[m], 1) for m in deltas}
    judged = {m for m in deltas if norms[m] > 0}
    centre = Centre({})
    if len(judged) >= MIN_ANSWERS:
        centre = centre_of({m: deltas[m] for m in judged}, norms, sketch)
        ref: float | None = statistics.median(per_step[m] for m in judged)
    else:
        ref = history
    cosines = centre.cosines
    typical = statistics.median(cosines.values()) if cosines else 0.0
    verdicts = {}
    for m in deltas:
        if norms[m] <= 0:  # steps claimed, nothing moved: tokens without progress dilute the merge
            verdicts[m] = Verdict(0.0, 0.0, math.inf)
            continue
        cos = cosines.get(m, math.nan)
        alignment = cos / typical if typical > 0 and m in cosines else 1.0
        bound = clip * ref if clip > 0 and ref is not None and ref > 0 else math.inf
        room = bound / per_step[m] if per_step[m] > 0 else math.inf
        residual = None
        if m in centre.units and centre.centre is not None and ref is not None and ref > 0:
            size = per_step[m] * min(1.0, room) / ref
            residual = (centre.units[m] - cos * centre.centre).mul_(size)
        verdicts[m] = Verdict(cos, alignment, room, residual)
    return verdicts


@dataclass(frozen=True)
class Drift:
    """One learner's residuals in one fragment, decayed over its judged answers: the part of
    what it sends off the centre that points the same way round after round.

    With residuals r_a (a answers ago) and weights g^a: ``total`` = sum g^a r_a, ``weight`` =
    sum g^a, ``weight_sq`` = sum g^2a, ``energy`` = sum g^2a |r_a|^2. If the residuals are a
    fixed push c plus noise that does not repeat, E(|total|^2 - energy) = (weight^2 -
    weight_sq) |c|^2: |c| is estimated without knowing the noise's size (``consistent``). Noise
    alone gives about 0 however large; a push its size however hidden in one round."""

    total: torch.Tensor
    """sum g^a r_a (sketched)."""
    weight: float = 0.0
    """sum g^a."""
    weight_sq: float = 0.0
    """sum g^2a."""
    energy: float = 0.0
    """sum g^2a |r_a|^2."""
    rounds: int = 0
    """Judged answers it holds."""

    @staticmethod
    def empty(dim: int = SKETCH_DIM) -> Drift:
        """A learner's drift before its first judged answer."""
        return Drift(torch.zeros(dim))

    def add(self, residual: torch.Tensor, decay: float) -> Drift:
        """The drift after one more judged answer of residual ``residual`` (sketched)."""
        return Drift(
            self.total * decay + residual,
            self.weight * decay + 1.0,
            self.weight_sq * decay * decay + 1.0,
            self.energy * decay * decay + float(residual @ residual),
            self.rounds + 1,
        )

    def consistent(self) -> float:
        """The estimated size of the push its residuals repeat (0 with fewer than 2 answers)."""
        spread = self.weight * self.weight - self.weight_sq
        if self.rounds < 2 or spread <= 0:
            return 0.0
        return math.sqrt(max(0.0, (float(self.total @ self.total) - self.energy) / spread))


def drift_target(drift: float, limit: float) -> float:
    """The trust a learner of ``drift`` (its consistent push over the round's median one) is
    pulled to: 1 up to half the limit, 0 at the limit or above, linear between."""
    if limit <= 0:
        return 1.0
    return min(1.0, max(0.0, 2.0 - 2.0 * drift / limit))


def trust_after(trust: float, alignment: float, decay: float) -> float:
    """A learner's trust after one judged answer: an exponential average of its alignments,
    each counted at most 1 (being more aligned than the median earns nothing) and at least 0.
    It falls at ``decay`` and recovers four times slower: a learner cannot buy back in one good
    answer the trust it lost in a bad one."""
    target = min(max(alignment, 0.0), 1.0)
    keep = decay if target < trust else 1.0 - (1.0 - decay) / 4
    return keep * trust + (1.0 - keep) * target


def trust_factor(trust: float, full: float) -> float:
    """The weight multiplier of a learner of ``trust``: 1 at ``full`` or above, proportional
    below. An honest learner's trust stays above ``full`` (on the healthy arm its alignments
    were never below 0.78); one that is, round after round, half as aligned as its peers keeps
    little of its weight, though no single answer crossed a bound."""
    return 1.0 if trust >= full else max(trust, 0.0) / full


def tolerance(num_learners: int) -> str:
    """What the robust merge tolerates with ``num_learners`` learners, for the start-up log."""
    f = (num_learners - 1) // 2
    if num_learners < MIN_ANSWERS:
        return (
            f"robust merge: with {num_learners} learner(s) no round has a majority; only the size clipping "
            "against the fragment's history and the weight cap bound a keyed learner (no direction check)"
        )
    return (
        f"robust merge: tolerates {f} keyed attacker(s) among {num_learners} learners (fewer than half of "
        "each round's answers, and rounds need 3 answers for the direction check)"
    )
