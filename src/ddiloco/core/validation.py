"""Checks a contribution must pass before it can touch global state.

Each check returns None, or the rejection's keyword and a line for a human. Finiteness is not
checked here: the outer-gradient norm that the merge needs anyway is NaN or inf exactly when
a value is not finite (or the norm overflows), and ``check_norm`` refuses both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import cast

import torch

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import Piece
from ddiloco.core.messages import Contribution
from ddiloco.core.tape import RejectReason

Problem = tuple[RejectReason, str]


def check_counters(steps: object, tokens: object, cfg: DiLoCoConfig) -> Problem | None:
    """The weight is tokens^2/steps, so one inflated counter would otherwise dominate a merge."""
    if not isinstance(steps, int) or not isinstance(tokens, int):
        return "bad_counters", "counters must be integers"
    if steps < 0 or tokens < 0:
        return "bad_counters", f"negative counters (steps={steps}, tokens={tokens})"
    if tokens > 0 and steps < 1:
        return "bad_counters", f"tokens={tokens} with steps={steps}: tokens need at least one step"
    if steps > 0 and tokens / steps > cfg.max_tokens_per_step:
        return "bad_counters", (
            f"tokens/steps = {tokens / steps:.3g} exceeds max_tokens_per_step = {cfg.max_tokens_per_step:.3g}"
        )
    return None


def check_routed(c: Contribution, pieces: Sequence[Piece], rows: Mapping[str, int]) -> Problem | None:
    """Routed-token counts share an answer's weight among a tensor's rows: one per row of the
    piece's whole tensor (``rows``: each tensor's rows), each an integer in [0, tokens] (a token
    reaches an expert at most once), the same for every piece of one tensor."""
    routed = cast(list[object], c.routed)  # decoded from outside: check, don't trust
    if not isinstance(routed, list) or not routed:
        return None if isinstance(routed, list) else ("bad_counters", "routed counts must be a list")
    if len(routed) != len(pieces):
        return "bad_counters", f"routed counts for {len(routed)} pieces, fragment {c.fragment} has {len(pieces)}"
    seen: dict[str, list[object]] = {}
    for pc, counts in zip(pieces, routed):
        if not isinstance(counts, list):
            return "bad_counters", f"routed counts of {pc.name} must be a list"
        if not counts:
            continue
        n = rows.get(pc.name, 0)
        if pc.kind != "param" or len(counts) != n:
            what = "a buffer" if pc.kind != "param" else f"{n} rows"
            return "bad_counters", f"{len(counts)} routed counts for {pc.name} ({what})"
        if seen.setdefault(pc.name, counts) != counts:
            return "bad_counters", f"two pieces of {pc.name} carry different routed counts"
        for r in counts:
            if type(r) is not int or not 0 <= r <= c.tokens:
                return "bad_counters", f"routed count {r!r} of {pc.name} is not an integer in [0, tokens={c.tokens}]"
    return None


def check_payload(c: Contribution, pieces: Sequence[Piece]) -> Problem | None:
    """The tensors must match the fragment's layout: count, shapes and dtype."""
    if c.kind not in ("values", "delta"):
        return "bad_payload", f"unknown payload kind {c.kind!r}"
    if len(c.values) != len(pieces):
        return "bad_payload", f"fragment {c.fragment} has {len(pieces)} tensors, contribution has {len(c.values)}"
    for pc, v in zip(pieces, cast(list[object], c.values)):  # decoded from outside: check, don't trust
        if not isinstance(v, torch.Tensor):
            return "bad_payload", f"{pc.name}: not a tensor"
        if tuple(v.shape) != pc.shape:
            return (
                "bad_payload",
                f"{pc.name}[{pc.row_start}:{pc.row_end}]: shape {tuple(v.shape)} != expected {pc.shape}",
            )
        if v.dtype != torch.float32:
            return "bad_payload", f"{pc.name}: dtype {v.dtype} != expected torch.float32"
    return None


def check_norm(norms: Sequence[float], cfg: DiLoCoConfig) -> Problem | None:
    """The outer gradient's L2 norm (from its pieces' norms) must be finite and bounded."""
    norm = math.sqrt(sum(n * n for n in norms))
    if not math.isfinite(norm):
        return "bad_payload", "non-finite values in the contribution"
    if norm > cfg.max_delta_norm:
        return "bad_norm", f"outer-gradient norm {norm:.3g} exceeds max_delta_norm = {cfg.max_delta_norm:.3g}"
    return None


def check_update(values: Sequence[object], pieces: Sequence[Piece]) -> str | None:
    """Why a received global fragment cannot be applied (count, shapes, dtype, finiteness), or
    None. A learner writes these values straight into its model: it checks them first."""
    if len(values) != len(pieces):
        return f"{len(values)} tensors for a fragment of {len(pieces)}"
    for pc, v in zip(pieces, values):
        if not isinstance(v, torch.Tensor):
            return f"{pc.name}: not a tensor"
        if tuple(v.shape) != pc.shape:
            return f"{pc.name}: shape {tuple(v.shape)} != expected {pc.shape}"
        if v.dtype != torch.float32:
            return f"{pc.name}: dtype {v.dtype} != expected torch.float32"
        if not bool(torch.isfinite(v).all()):
            return f"{pc.name}: non-finite values"
    return None


COUNT_LIMIT = 2**24
"""An integer buffer must stay below this: the wire and the syncer carry values as fp32, exact
for integers up to 2^24."""


def check_buffers(
    values: Sequence[torch.Tensor], base: Sequence[torch.Tensor], pieces: Sequence[Piece], steps: int, cfg: DiLoCoConfig
) -> Problem | None:
    """A contribution's buffers (its values, not changes) against the version it started from:
    finite; a variance never negative; a change within ``max_delta_norm``; an integer buffer a
    non-negative integer that grew by at most ``max_count_per_step`` per step and stays below
    ``COUNT_LIMIT``. Buffers are merged by a mean of the answers' values, so one hostile value
    would otherwise be carried into the global model."""
    for pc, v, b in zip(pieces, values, base):
        if pc.kind == "param":
            continue
        where = f"buffer {pc.name}"
        if not bool(torch.isfinite(v).all()):
            return "bad_buffer", f"{where}: non-finite values"
        if pc.kind == "buffer":
            if pc.name.endswith("running_var") and bool((v < 0).any()):
                return "bad_buffer", f"{where}: a negative variance ({float(v.min()):.3g})"
            change = float(torch.linalg.vector_norm(v - b))
            if change > cfg.max_delta_norm:
                return (
                    "bad_buffer",
                    f"{where}: changed by {change:.3g}, beyond max_delta_norm = {cfg.max_delta_norm:.3g}",
                )
            continue
        if bool((v != v.round()).any()) or bool((v < 0).any()):
            return "bad_buffer", f"{where}: a count must be a non-negative integer"
        moved = v - b
        low, high = (float(moved.min()), float(moved.max())) if v.numel() else (0.0, 0.0)
        most = steps * cfg.max_count_per_step
        if low < 0 or high > most:
            return "bad_buffer", (
                f"{where}: a count moved by {low if low < 0 else high:.0f} in {steps} steps (allowed: 0 .. {most}, "
                f"max_count_per_step = {cfg.max_count_per_step})"
            )
        if bool((v >= COUNT_LIMIT).any()):
            return (
                "bad_buffer",
                f"{where}: a count of {float(v.max()):.0f} is beyond 2^24, which fp32 cannot carry exactly",
            )
    return None
