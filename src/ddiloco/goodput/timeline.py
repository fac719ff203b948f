"""One simulated timeline of a fleet: which slice fails when, and when it comes back.

Each slice position fails as a Poisson process at (its chips / MTBI). A failure of a slice in
service takes it to repair; a failure drawn for a position whose slice is in repair hits
whatever stands in for it: nothing in an elastic job (the event is ignored), a hot spare in a
non-elastic job (which therefore always sees the full failure rate N / MTBI). Every strategy
is simulated on this same timeline and the same recovery-time draws per event, so differences
between strategies are not sampling noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddiloco.chaos import repair_mask, unit_failures
from ddiloco.goodput.config import CostModel, FailureModel, SimConfig, check_chips, n_slices


@dataclass(frozen=True)
class FleetTimeline:
    """Slice failures and returns of one fleet over ``[0, horizon_s)``, sorted by time."""

    slice_chips: np.ndarray
    """Chips in each slice (the last slice may be partial)."""
    slice_speed: np.ndarray
    """Speed of each slice (its slowest chip), 1.0 without speed variance."""
    t: np.ndarray
    """Event times, seconds, ascending."""
    slice_id: np.ndarray
    """Slice of each event."""
    is_failure: np.ndarray
    """True for a failure, False for a return from repair."""
    hits_spare: np.ndarray
    """True for a failure at a position whose own slice is in repair: it only matters to a
    non-elastic job, whose hot spare stands there."""
    reconfig_s: np.ndarray
    """Elastic pause this event starts: a downscale draw for a failure, an upscale draw for a
    return."""
    restart_s: np.ndarray
    """Non-elastic restart this event starts (used for failures only)."""
    warmup_s: float
    """Start of the measured window."""
    horizon_s: float
    """End of the timeline and of the measured window."""

    @property
    def chips(self) -> int:
        return int(self.slice_chips.sum())


def make_timeline(
    chips: int,
    seed: int,
    failure: FailureModel,
    costs: CostModel,
    sim: SimConfig,
    horizon_s: float | None = None,
    warmup_s: float | None = None,
) -> FleetTimeline:
    """Sample the timeline of a ``chips`` fleet for ``seed`` (reproducible bit for bit)."""
    chips = check_chips(chips)
    warm, horizon = sim.window(failure)
    if horizon_s is not None:
        warm = warm if warmup_s is None else warmup_s
        horizon = warm + horizon_s
    n = n_slices(chips, failure.slice_chips)
    sizes = np.full(n, failure.slice_chips, dtype=np.int64)
    sizes[-1] = chips - (n - 1) * failure.slice_chips
    # Separate streams per concern so that e.g. turning speed variance on leaves the failure
    # timeline unchanged.
    s_fail, s_cost, s_speed = np.random.SeedSequence([seed, chips]).spawn(3)
    rng = np.random.default_rng(s_fail)
    unit, f = unit_failures(rng, sizes / failure.mtbi_s, horizon)
    rep = np.asarray(failure.repair.sample(rng, f.size), float)
    up = repair_mask(unit, f, rep)
    r = (f + rep)[up]
    back = r < horizon
    t = np.concatenate([f, r[back]])
    sid = np.concatenate([unit, unit[up][back]])
    is_fail = np.concatenate([np.ones(f.size, bool), np.zeros(int(back.sum()), bool)])
    spare = np.concatenate([~up, np.zeros(int(back.sum()), bool)])
    order = np.argsort(t, kind="stable")
    t, sid, is_fail, spare = t[order], sid[order], is_fail[order], spare[order]
    rng = np.random.default_rng(s_cost)
    down = np.asarray(costs.downscale.sample(rng, t.size), float)
    up = np.asarray(costs.upscale.sample(rng, t.size), float)
    restart = np.asarray(costs.restart.sample(rng, t.size), float)
    speed = _slice_speeds(np.random.default_rng(s_speed), sizes, failure.speed_cv)
    return FleetTimeline(
        slice_chips=sizes,
        slice_speed=speed,
        t=t,
        slice_id=sid.astype(np.int64),
        is_failure=is_fail,
        hits_spare=spare,
        reconfig_s=np.where(is_fail, down, up),
        restart_s=restart,
        warmup_s=float(warm),
        horizon_s=float(horizon),
    )


def _slice_speeds(rng: np.random.Generator, sizes: np.ndarray, cv: float) -> np.ndarray:
    if cv <= 0:
        return np.ones(sizes.size)
    # One draw per chip, then the slowest chip of each slice. Speeds are relative to the
    # nominal step time, so a fast chip cannot push a synchronous step above 1.
    chip = np.clip(rng.normal(1.0, cv, int(sizes.sum())), 0.05, 1.0)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return np.minimum.reduceat(chip, starts)
