"""Merging outer gradients: token weights, weighted mean and weighted RDA (per tensor, or
row by row for an expert-stacked tensor: ``RowAccumulator``).

A learner's outer gradient for one tensor is ``delta = anchor - values`` (the global value it
started from minus its own), or the payload itself for a 'delta' payload. The syncer merges as
contributions arrive, so each is read from memory as few times as the maths allows:

- ``make_delta`` turns the received tensor into its outer gradient in place and measures its
  norm in the same pass, chunk by chunk while the chunk is in cache (the norm is needed anyway:
  to validate the contribution, and by RDA);
- ``Accumulator.add`` adds it, weighted, into the round's running sum in one more pass (the
  weight is only known once the contribution is accepted, and RDA needs the norm first); the
  first addition zeroes the sum chunk by chunk in the same pass, so the sum is never cleared
  through memory on its own;
- ``Accumulator.result`` turns the sum into the merged outer gradient when the round closes.

Threads: the element-wise operations use torch's intra-op threads (``torch.set_num_threads``),
which split an operation into pieces of at least 32768 elements. Chunks grow with the thread
count (``chunk_elements``) so that every thread gets a piece worth its start-up cost. Results are
bit-identical for a given thread count: element-wise results do not depend on the chunking; the
chunked norms (a sum in another order) may differ in the last bits when the chunk size changes.

RDA, with weights w and deltas d of norms n: ``(sum w n / sum w) * unit(sum w unit(d))``, the
mean norm along the mean direction (unit(0) = 0). Outer gradients of different learners are
nearly orthogonal, so a plain mean shrinks like 1/sqrt(M); RDA keeps the step length
independent of M.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

CHUNK = 1 << 18
"""Elements per chunk at up to 4 threads (1 MB of fp32): a chunk stays in the cache between two
operations, and chunks are large enough that Python's per-operation cost stays small."""

PER_THREAD = 1 << 16
"""Elements of a chunk per intra-op thread above 4 threads (256 KB of fp32 each: a piece that
stays in a core's L2 and is large against the cost of starting a parallel region)."""


def chunk_elements() -> int:
    """Elements per chunk for torch's current intra-op thread count."""
    return max(CHUNK, torch.get_num_threads() * PER_THREAD)


def token_weight(tokens: float, steps: float) -> float:
    """w = tokens^2 / steps ("quantity times quality": tokens x tokens per step); 0 if no steps."""
    if steps <= 0:
        return 0.0
    return float(tokens) * float(tokens) / float(steps)


def spans(numel: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each chunk of a flat tensor of ``numel`` elements."""
    chunk = chunk_elements()
    return [(s, min(s + chunk, numel)) for s in range(0, numel, chunk)]


def make_delta(anchor: torch.Tensor | None, values: torch.Tensor) -> float:
    """Overwrite ``values`` with ``anchor - values`` (leave it when ``anchor`` is None: it already
    is a delta) and return the L2 norm of the result: NaN or inf when a value is not finite."""
    v = values.view(-1)
    if anchor is None:
        return float(torch.linalg.vector_norm(v))
    a = anchor.reshape(-1)
    total = 0.0
    for s, e in spans(v.numel()):
        d = torch.sub(a[s:e], v[s:e], out=v[s:e])
        total += float(torch.linalg.vector_norm(d)) ** 2
    return math.sqrt(total)


class Accumulator:
    """The running token-weighted merge of one tensor in one round."""

    def __init__(self, out: torch.Tensor, rda: bool) -> None:
        """``out`` is scratch space of the tensor's shape (its contents are overwritten: zeroed
        by the first addition, or by ``result`` if nothing was added)."""
        self.acc = out
        self.cleared = False  # the sum is zero only once cleared (lazily, fused with the first add)
        self.rda = rda
        self.weight = 0.0  # sum of w
        self.radius = 0.0  # sum of w * n
        # The deltas in the sum with their scales (references, not copies).
        self.members: list[tuple[torch.Tensor, float]] = []

    def add(self, delta: torch.Tensor, norm: float, weight: float, sign: float = 1.0, scale: float = 1.0) -> None:
        """Add (sign = 1) or take back (sign = -1) one learner's delta of norm ``norm``, as if
        it were ``scale * delta`` (the staleness discount: the tensor itself is not touched)."""
        if weight <= 0:
            return
        self.weight += sign * weight
        self.radius += sign * weight * scale * norm
        if sign > 0:
            self.members.append((delta, scale))
        else:
            self.members = [(d, s) for d, s in self.members if d is not delta]
        # RDA only takes the direction from the sum: a scale changes the radius, not the direction.
        coef = (weight / norm if norm > 0 else 0.0) if self.rda else weight * scale
        if coef == 0.0:
            return
        if self.cleared:
            self.acc.add_(delta, alpha=sign * coef)
            return
        # The first addition: clear and add chunk by chunk, while the chunk is in cache (the
        # same numbers as zero_() then add_(): 0 + x, so -0 still becomes +0).
        acc, d = self.acc.view(-1), delta.reshape(-1)
        for s, e in spans(acc.numel()):
            acc[s:e].zero_().add_(d[s:e], alpha=sign * coef)
        self.cleared = True

    def result(self) -> torch.Tensor:
        """The merged outer gradient (the scratch tensor, handed over; or, for a lone learner,
        its delta itself: both merges are exactly that delta then, with no rounding)."""
        if self.weight <= 0:
            raise ValueError("merge needs a positive total weight")
        if len(self.members) == 1:
            delta, scale = self.members[0]
            return delta if scale == 1.0 else delta.mul_(scale)
        if not self.cleared:  # nothing was added (all coefficients 0): the sum is zero
            self.acc.zero_()
            self.cleared = True
        if not self.rda:
            return self.acc.div_(self.weight)
        direction = float(torch.linalg.vector_norm(self.acc))
        return self.acc.mul_(self.radius / self.weight / direction) if direction > 0 else self.acc


class RowAccumulator:
    """The running merge of one tensor whose rows are weighed apart (``algo.expert_weights =
    "routed"``: row e of a mixture of experts' stacked tensor is expert e).

    Row e of an answer counts with ``weight x factors[e]``. The mean is taken row by row, and
    RDA keeps each row's weighted mean length along its weighted mean direction (the experts are
    separate subspaces: one expert's long step must not set another's length). A row that no
    answer weighs gets a zero outer gradient (the outer momentum still moves it)."""

    def __init__(self, out: torch.Tensor, rda: bool) -> None:
        """``out`` is scratch space of the tensor's shape (overwritten, as ``Accumulator``'s)."""
        self.acc = out
        self.rda = rda
        self.rows = out.shape[0] if out.dim() > 0 else 1
        self.weight = torch.zeros(self.rows, dtype=torch.float64)  # per row: sum of w x factor
        self.radius = torch.zeros(self.rows, dtype=torch.float64)  # per row: sum of w x factor x n
        self.cleared = False

    def add(
        self,
        delta: torch.Tensor,
        norm: float,
        weight: float,
        sign: float = 1.0,
        scale: float = 1.0,
        factors: torch.Tensor | None = None,
    ) -> None:
        """Add (sign = 1) or take back (sign = -1) one answer's ``delta`` (``norm`` is its whole
        norm: the rows measure their own), its rows weighted ``weight x factors`` (all 1 when
        None), as if it were ``scale * delta``."""
        if weight <= 0:
            return
        w = torch.full((self.rows,), float(weight), dtype=torch.float64)
        if factors is not None:
            w.mul_(factors)
        self.weight.add_(w, alpha=sign)
        d = delta.reshape(self.rows, -1)
        if self.rda:
            n = torch.linalg.vector_norm(d, dim=1, dtype=torch.float64)
            self.radius.add_(w * n, alpha=sign * scale)
            coef = torch.where(n > 0, w / n.clamp(min=1e-300), 0.0)
        else:
            coef = w * scale
        if not self.cleared:
            self.acc.zero_()
            self.cleared = True
        self.acc.view(self.rows, -1).addcmul_(d, coef.to(self.acc.dtype).unsqueeze(1), value=sign)

    def result(self) -> torch.Tensor:
        """The merged outer gradient, row by row (the scratch tensor, handed over)."""
        acc = self.acc.view(self.rows, -1)
        if not self.cleared:
            acc.zero_()
            self.cleared = True
        weighed = self.weight > 0
        if self.rda:
            direction = torch.linalg.vector_norm(acc, dim=1, dtype=torch.float64)
            ok = weighed & (direction > 0)
            scale = torch.where(ok, self.radius / self.weight.clamp(min=1e-300) / direction.clamp(min=1e-300), 0.0)
        else:
            scale = torch.where(weighed, 1.0 / self.weight.clamp(min=1e-300), 0.0)
        acc.mul_(scale.to(acc.dtype).unsqueeze(1))
        return self.acc


def row_factors(routed: Sequence[int], row_start: int, row_end: int) -> torch.Tensor:
    """Rows [row_start, row_end) of ``rows x routed / sum(routed)``: an answer's token weight
    shared among a tensor's rows in proportion to the tokens it routed to each (their mean over
    the tensor is 1, so counts move weight between experts and never add any: one row gets at
    most ``rows`` times, whatever is claimed). All zero when nothing was routed."""
    counts = torch.tensor(routed, dtype=torch.float64)
    total = float(counts.sum())
    if total <= 0:
        return torch.zeros(row_end - row_start, dtype=torch.float64)
    return counts[row_start:row_end].mul_(len(routed) / total)


def _merge(deltas: Sequence[torch.Tensor], weights: Sequence[float], rda: bool) -> torch.Tensor:
    acc = Accumulator(torch.empty_like(deltas[0], dtype=torch.float32), rda)
    for d, w in zip(deltas, weights):
        acc.add(d.float(), float(torch.linalg.vector_norm(d.float())), float(w))
    return acc.result()


def weighted_mean(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum(w_m * delta_m) / sum(w_m) of materialised deltas."""
    return _merge(deltas, weights, rda=False)


def weighted_rda(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Weighted radial-directional averaging of materialised deltas."""
    return _merge(deltas, weights, rda=True)
