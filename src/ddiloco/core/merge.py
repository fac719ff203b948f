"""Merging outer gradients: token weights, weighted mean and weighted RDA."""

from __future__ import annotations

from typing import Sequence

import torch


def token_weight(tokens: float, steps: float) -> float:
    """w = tokens^2 / steps ("quantity times quality": tokens x tokens per step); 0 if no steps."""
    if steps <= 0:
        return 0.0
    return float(tokens) * float(tokens) / float(steps)


def _normalised(weights: Sequence[float]) -> list[float]:
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("merge needs a positive total weight")
    return [float(w) / total for w in weights]


def weighted_mean(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum(w_m * delta_m) / sum(w_m)."""
    out = torch.zeros_like(deltas[0], dtype=torch.float32)
    for d, w in zip(deltas, _normalised(weights)):
        out.add_(d.float(), alpha=w)
    return out


def weighted_rda(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Weighted radial-directional averaging of one tensor.

    (sum w|d| / sum w) * unit(sum w unit(d) / sum w): the mean norm along the mean direction.
    Outer gradients of different learners are nearly orthogonal, so a plain mean shrinks like
    1/sqrt(M); RDA keeps the step length independent of M.
    """
    ws = _normalised(weights)
    if len(deltas) == 1:
        return deltas[0].float().clone()
    norms = [float(torch.linalg.vector_norm(d.float())) for d in deltas]
    radius = sum(w * n for w, n in zip(ws, norms))
    direction = torch.zeros_like(deltas[0], dtype=torch.float32)
    for d, w, n in zip(deltas, ws, norms):
        if n > 0:  # unit(0) = 0
            direction.add_(d.float(), alpha=w / n)  # in place: no temporary per learner
    dn = float(torch.linalg.vector_norm(direction))
    return direction.mul_(radius / dn) if dn > 0 else direction


def merge_deltas(
    per_learner: Sequence[Sequence[torch.Tensor]],
    weights: Sequence[float],
    embedding_like: Sequence[bool],
    method: str = "rda",
) -> list[torch.Tensor]:
    """Merge several learners' outer gradients piece by piece.

    ``per_learner[m][i]`` is learner m's outer gradient for piece i; ``embedding_like[i]``
    selects the weighted mean for that piece; other pieces use ``method`` ('rda' or 'mean').
    """
    merged = []
    for i, is_emb in enumerate(embedding_like):
        pieces = [d[i] for d in per_learner]
        if is_emb or method == "mean":
            merged.append(weighted_mean(pieces, weights))
        else:
            merged.append(weighted_rda(pieces, weights))
    return merged
