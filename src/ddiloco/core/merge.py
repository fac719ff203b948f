"""Merging outer gradients: token weights, weighted mean and weighted RDA.

A learner's outer gradient for one tensor is ``delta = anchor - values`` (the global value it
started from minus its own), or ``values`` itself for a 'delta' payload. The syncer never
materialises the deltas: it keeps each learner's received tensor as it came, and the merge
walks the tensors in cache-sized chunks, so each contribution is read from memory once per
pass: once on arrival (its norm) and once when the round closes (accumulated into the merge).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

CHUNK = 1 << 16
"""Elements per chunk (256 KB of fp32): the working set of one chunk stays in the L2 cache."""


@dataclass(frozen=True)
class Term:
    """One learner's outer gradient of one tensor: ``anchor - values``, or ``values`` when
    ``anchor`` is None. ``norm`` is its L2 norm (from ``delta_norm``)."""

    anchor: torch.Tensor | None
    values: torch.Tensor
    norm: float


def token_weight(tokens: float, steps: float) -> float:
    """w = tokens^2 / steps ("quantity times quality": tokens x tokens per step); 0 if no steps."""
    if steps <= 0:
        return 0.0
    return float(tokens) * float(tokens) / float(steps)


def _chunks(numel: int) -> range:
    return range(0, numel, CHUNK)


def delta_norm(anchor: torch.Tensor | None, values: torch.Tensor) -> float:
    """L2 norm of ``anchor - values`` (or of ``values``), chunk by chunk without a temporary of
    the whole tensor. NaN or inf when a value is not finite."""
    v = values.reshape(-1)
    if anchor is None:
        return float(torch.linalg.vector_norm(v))
    a = anchor.reshape(-1)
    tmp = torch.empty(min(CHUNK, v.numel()), dtype=torch.float32)
    total = 0.0
    for s in _chunks(v.numel()):
        e = min(s + CHUNK, v.numel())
        d = torch.sub(a[s:e], v[s:e], out=tmp[: e - s])
        total += float(torch.linalg.vector_norm(d)) ** 2
    return math.sqrt(total)


def _normalised(weights: Sequence[float]) -> list[float]:
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("merge needs a positive total weight")
    return [float(w) / total for w in weights]


def merge_tensor(terms: Sequence[Term], weights: Sequence[float], rda: bool) -> torch.Tensor:
    """The weighted mean ``sum(w*delta)/sum(w)`` of the terms' deltas, or with ``rda`` the
    weighted radial-directional average ``(sum w|d| / sum w) * unit(sum w unit(d) / sum w)``:
    the mean norm along the mean direction, with unit(0) = 0.

    Outer gradients of different learners are nearly orthogonal, so a plain mean shrinks like
    1/sqrt(M); RDA keeps the step length independent of M.
    """
    ws = _normalised(weights)
    if rda and len(terms) == 1:
        coefs, radius = [1.0], None  # one learner: RDA is its delta, exactly
    elif rda:
        coefs = [w / t.norm if t.norm > 0 else 0.0 for w, t in zip(ws, terms)]
        radius = sum(w * t.norm for w, t in zip(ws, terms))
    else:
        coefs, radius = ws, None
    shape, numel = terms[0].values.shape, terms[0].values.numel()
    out = torch.empty(numel, dtype=torch.float32)
    tmp = torch.empty(min(CHUNK, numel), dtype=torch.float32)
    flat = [(None if t.anchor is None else t.anchor.reshape(-1), t.values.reshape(-1)) for t in terms]
    direction_sq = 0.0
    # Chunk-major: the accumulator chunk stays in cache while every contribution streams through.
    for s in _chunks(numel):
        e = min(s + CHUNK, numel)
        acc = out[s:e].zero_()
        for (a, v), c in zip(flat, coefs):
            if c == 0.0:
                continue
            d = v[s:e] if a is None else torch.sub(a[s:e], v[s:e], out=tmp[: e - s])
            acc.add_(d, alpha=c)
        if radius is not None:
            direction_sq += float(torch.linalg.vector_norm(acc)) ** 2
    if radius is not None:
        dn = math.sqrt(direction_sq)
        if dn > 0:
            out.mul_(radius / dn)
    return out.reshape(shape)


def merge_fragment(
    per_learner: Sequence[Sequence[Term]],
    weights: Sequence[float],
    embedding_like: Sequence[bool],
    method: str = "rda",
) -> list[torch.Tensor]:
    """Merge several learners' outer gradients of one fragment, piece by piece.

    ``per_learner[m][i]`` is learner m's term for piece i; ``embedding_like[i]`` selects the
    weighted mean for that piece; other pieces use ``method`` ('rda' or 'mean').
    """
    return [
        merge_tensor([terms[i] for terms in per_learner], weights, rda=method == "rda" and not is_emb)
        for i, is_emb in enumerate(embedding_like)
    ]


def _terms(deltas: Sequence[torch.Tensor]) -> list[Term]:
    return [Term(None, d.float(), delta_norm(None, d.float())) for d in deltas]


def weighted_mean(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum(w_m * delta_m) / sum(w_m) of materialised deltas."""
    return merge_tensor(_terms(deltas), weights, rda=False)


def weighted_rda(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Weighted radial-directional averaging of materialised deltas (see ``merge_tensor``)."""
    return merge_tensor(_terms(deltas), weights, rda=True)
