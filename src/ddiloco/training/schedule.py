"""Learning-rate schedules over the fleet's position in the run, not a step count.

A learner's share of the run's steps is not known in advance (learners run at their own
speeds, fail, rejoin, and a restarted process starts counting from zero), so a schedule that
counts its own steps (``OneCycleLR(total_steps=...)``, ``CosineAnnealingLR(T_max=...)``)
drifts from the run and starts over on a restart. These schedules are functions of the
*fraction* of the run's token budget the fleet has processed, which every learner estimates
(``Learner.fleet_fraction``): every learner, and a restarted one, sits at the fleet's position.

``lr_multiplier`` is the pure rule (the built-in training loop's schedule is its cosine shape);
``fleet_scheduler`` wraps it as a ``LambdaLR`` for a user's own loop.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal, Protocol, get_args

from ddiloco.errors import UsageError

if TYPE_CHECKING:
    import torch

Shape = Literal["cosine", "linear", "one_cycle", "constant"]
SHAPES: tuple[str, ...] = get_args(Shape)


def lr_multiplier(
    fraction: float,
    shape: Shape = "cosine",
    *,
    warmup: float = 0.05,
    final: float = 0.1,
    start: float = 0.0,
    ramp_floor: float = 0.0,
) -> float:
    """The peak learning rate's multiplier when the fleet has processed ``fraction`` (0..1,
    clamped) of the run's tokens.

    Every shape warms up over the first ``warmup`` of the run, then decays to ``final`` at the
    end of the run:

    - ``cosine``: linear warm-up from ``start``, then a half cosine down to ``final``;
    - ``linear``: linear warm-up from ``start``, then a straight line down to ``final``;
    - ``one_cycle``: ``OneCycleLR``'s shape (``anneal_strategy="cos"``): a half cosine up from
      ``start`` over the warm-up, then a half cosine down to ``final`` (its defaults are
      ``start = 1/25`` and ``final = 1/25e4``; pass them for the same curve);
    - ``constant``: linear warm-up from ``start``, then 1.

    ``ramp_floor`` keeps the linear warm-up's first value above 0 (the built-in loop's
    ``(tokens + 1) / (warm + 1)``, in fraction units).
    """
    if shape not in SHAPES:
        raise UsageError(f"unknown schedule shape {shape!r}: use one of {', '.join(SHAPES)}")
    f = min(1.0, max(0.0, fraction))
    if f < warmup:
        if shape == "one_cycle":
            return half_cosine(start, 1.0, f / warmup)
        return start + (1.0 - start) * (f + ramp_floor) / (warmup + ramp_floor)
    if shape == "constant":
        return 1.0
    past = min(1.0, (f - warmup) / max(1.0 - warmup, 1e-12))
    if shape == "linear":
        return 1.0 + (final - 1.0) * past
    if shape == "cosine":
        return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * past))
    return half_cosine(1.0, final, past)


def half_cosine(begin: float, end: float, progress: float) -> float:
    """A half cosine from ``begin`` (progress 0) to ``end`` (progress 1), as ``OneCycleLR``
    anneals."""
    return end + (begin - end) / 2.0 * (math.cos(math.pi * progress) + 1)


class FleetPosition(Protocol):
    """What a schedule reads of a learner (``ddiloco.Learner`` has it)."""

    @property
    def fleet_fraction(self) -> float:
        """The fraction (0..1) of the run's token budget the fleet has processed."""
        ...


def fleet_scheduler(
    optimizer: torch.optim.Optimizer,
    learner: FleetPosition,
    shape: Shape = "cosine",
    *,
    warmup: float = 0.05,
    final: float = 0.1,
    start: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` that sets every param group's LR to its initial LR times
    ``lr_multiplier(learner.fleet_fraction, shape, ...)``, whatever its own step count.

    Build it after the ``Learner`` (the join tells it where the fleet is) and call its
    ``step()`` after ``optimizer.step()``, as any scheduler. A restarted learner that builds it
    again starts at the fleet's position, with no state to save or restore.
    """
    from torch.optim.lr_scheduler import LambdaLR

    if not 0.0 <= warmup < 1.0:
        raise UsageError(f"warmup is {warmup!r}: give the share of the run spent warming up, in [0, 1)")
    for name, value in (("final", final), ("start", start)):
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{name} is {value!r}: give a multiplier of the peak LR, >= 0")
    lr_multiplier(0.0, shape)  # an unknown shape fails here, not at the first step()

    def at_fleet_position(_step: int) -> float:
        return lr_multiplier(learner.fleet_fraction, shape, warmup=warmup, final=final, start=start)

    return LambdaLR(optimizer, at_fleet_position)
