"""Checks a contribution must pass before it can touch global state."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import Piece
from ddiloco.core.messages import Contribution


def check_counters(steps: int, tokens: int, cfg: DiLoCoConfig) -> str | None:
    """Why the counters are not sane, or None. The weight is tokens^2/steps, so one inflated
    counter would otherwise dominate a merge."""
    if not isinstance(steps, int) or not isinstance(tokens, int):
        return "counters must be integers"
    if steps < 0 or tokens < 0:
        return f"negative counters (steps={steps}, tokens={tokens})"
    if tokens > 0 and steps < 1:
        return f"tokens={tokens} with steps={steps}: tokens need at least one step"
    if steps > 0 and tokens / steps > cfg.max_tokens_per_step:
        return f"tokens/steps = {tokens / steps:.3g} exceeds max_tokens_per_step = {cfg.max_tokens_per_step:.3g}"
    return None


def check_payload(c: Contribution, pieces: Sequence[Piece]) -> str | None:
    """Why the tensors do not match the fragment's layout or are not finite, or None."""
    if c.kind not in ("values", "delta"):
        return f"unknown payload kind {c.kind!r}"
    if len(c.values) != len(pieces):
        return f"fragment {c.fragment} has {len(pieces)} tensors, contribution has {len(c.values)}"
    for pc, v in zip(pieces, c.values):
        if not isinstance(v, torch.Tensor):
            return f"{pc.name}: not a tensor"
        if tuple(v.shape) != pc.shape:
            return f"{pc.name}[{pc.row_start}:{pc.row_end}]: shape {tuple(v.shape)} != expected {pc.shape}"
        if v.dtype != torch.float32:
            return f"{pc.name}: dtype {v.dtype} != expected torch.float32"
        # A sum is finite unless some value is not (or it overflows): one fast vectorised pass,
        # and the exact element-wise check only when the sum says something is off.
        if not math.isfinite(float(v.sum())) and not bool(torch.isfinite(v).all()):
            return f"{pc.name}: non-finite values"
    return None


def check_delta_norm(deltas: Sequence[torch.Tensor], cfg: DiLoCoConfig) -> str | None:
    """Why the outer gradient is implausibly large, or None."""
    norm = math.sqrt(sum(float(torch.linalg.vector_norm(d)) ** 2 for d in deltas))
    if not math.isfinite(norm) or norm > cfg.max_delta_norm:
        return f"outer-gradient norm {norm:.3g} exceeds max_delta_norm = {cfg.max_delta_norm:.3g}"
    return None
