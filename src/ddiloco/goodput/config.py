"""Configs of the goodput simulator: the fleet's failure model, recovery costs, strategies.

The defaults of ``FailureModel`` and ``CostModel`` are the calibration documented in
docs/goodput.md (the median member of the parameter sets consistent with the paper's two
data-parallel rows, from bench/goodput.py); ``CALIBRATED`` records its numbers so the code and
the docs cannot drift apart silently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

from ddiloco.chaos import SECONDS_PER_YEAR, Distribution, Exponential, Weibull
from ddiloco.errors import ConfigError

# The median member of the set of calibrations consistent with the paper's DP rows (the
# principle is in docs/goodput.md); bench/goodput.py computes it and warns if it drifts from
# these. See docs/results/goodput.md.
CALIBRATED: dict[str, float] = {
    "restart_mean_s": 91.94,
    "reconfig_mean_s": 10.56,
    "recovery_shape": 0.8,
    "repair_mean_s": 4199.0,
}
SLICE_CHIPS = 256
"""Chips per slice (not fitted: the goodput of the DP rows depends on slice size and repair
time only through their product, so one of them has to be fixed; 256 is a TPU pod-slice
scale)."""
STEP_S = 2.0
"""Inner-step time assumed for lost work (not fitted)."""


@dataclass(frozen=True)
class FailureModel:
    """How chips fail and come back."""

    mtbi_s: float = SECONDS_PER_YEAR
    """Mean time between interruptions of one chip, seconds (paper: 1 year)."""
    slice_chips: int = SLICE_CHIPS
    """Chips per slice: the unit that fails together, is repaired, and is removed or added by
    elastic reconfiguration."""
    repair: Distribution = field(default_factory=lambda: Exponential(CALIBRATED["repair_mean_s"]))
    """Time from a slice's failure until it is back in service (repair or swap)."""
    speed_cv: float = 0.0
    """Per-chip speed variance (coefficient of variation of a normal around 1); a synchronous
    group advances at the speed of its slowest chip. 0 disables it."""

    def __post_init__(self) -> None:
        _positive("mtbi", self.mtbi_s)
        if not isinstance(self.slice_chips, int) or self.slice_chips < 1:
            raise ConfigError(f"slice_chips = {self.slice_chips!r}: must be an integer >= 1")
        if not (0.0 <= self.speed_cv < 0.5):
            raise ConfigError(f"speed_cv = {self.speed_cv!r}: must be in [0, 0.5)")


@dataclass(frozen=True)
class CostModel:
    """What a failure costs beyond the failed chips, per strategy.

    A recovery (restart or reconfiguration) interrupted by another change of the group's
    healthy set starts again with a fresh duration: the mesh being built still contained the
    slice that just died (or lacks the one that just came back).
    """

    restart: Distribution = field(
        default_factory=lambda: Weibull.from_mean(CALIBRATED["restart_mean_s"], CALIBRATED["recovery_shape"])
    )
    """Non-elastic data-parallel: time to reschedule the whole job on healthy slices (failed
    ones swapped for hot spares) and resume from the last checkpoint."""
    downscale: Distribution = field(
        default_factory=lambda: Weibull.from_mean(CALIBRATED["reconfig_mean_s"], CALIBRATED["recovery_shape"])
    )
    """Elastic group (elastic DP, or one Decoupled DiLoCo learner): pause to drop a failed
    slice and re-form the mesh."""
    upscale: Distribution = field(
        default_factory=lambda: Weibull.from_mean(CALIBRATED["reconfig_mean_s"], CALIBRATED["recovery_shape"])
    )
    """Elastic group: pause to add a repaired slice back."""
    step_s: float = STEP_S
    """Training step time; an elastic group loses the step in flight when a slice fails (its
    state survives in the other replicas)."""
    checkpoint_s: float = STEP_S
    """Non-elastic: interval between checkpoints (in-memory, every step by default); the work
    since the last one is lost on failure."""

    def __post_init__(self) -> None:
        _positive("step_s", self.step_s)
        _positive("checkpoint_s", self.checkpoint_s)


StrategyKind = Literal["dp", "elastic", "decoupled"]
STRATEGY_KINDS: tuple[StrategyKind, ...] = get_args(StrategyKind)


@dataclass(frozen=True)
class Strategy:
    """A way to run the job on the fleet."""

    kind: StrategyKind
    """``dp`` (data-parallel, not elastic), ``elastic`` (data-parallel, slice-granular
    elasticity) or ``decoupled`` (Decoupled DiLoCo)."""
    learners: int = 1
    """M: independent learners the fleet is split into (``decoupled`` only)."""
    quorum: int = 1
    """K: the system advances while at least K learners run (paper main runs: K = 1)."""

    def __post_init__(self) -> None:
        if self.kind not in STRATEGY_KINDS:
            raise ConfigError(
                f"strategy = {self.kind!r}: must be {', '.join(STRATEGY_KINDS[:-1])} or {STRATEGY_KINDS[-1]}"
            )
        if self.kind != "decoupled" and (self.learners, self.quorum) != (1, 1):
            raise ConfigError(f"strategy {self.kind}: learners and quorum apply to decoupled only")
        if not isinstance(self.learners, int) or self.learners < 1:
            raise ConfigError(f"learners (M) = {self.learners!r}: must be an integer >= 1")
        if not isinstance(self.quorum, int) or not 1 <= self.quorum <= self.learners:
            raise ConfigError(f"quorum (K) = {self.quorum!r}: must be an integer in " f"[1, M = {self.learners}]")

    @property
    def name(self) -> str:
        if self.kind == "dp":
            return "DP"
        if self.kind == "elastic":
            return "elastic DP"
        k = "" if self.quorum == 1 else f" K={self.quorum}"
        return f"DDiLoCo M={self.learners}{k}"

    @property
    def elastic(self) -> bool:
        return self.kind != "dp"


@dataclass(frozen=True)
class SimConfig:
    """How long and how often to simulate."""

    seeds: int = 20
    """Independent timelines per cell; confidence intervals are over these."""
    seed: int = 0
    """First seed; seed i of a cell with N chips uses SeedSequence([seed + i, N])."""
    measure_repairs: float = 20.0
    """Measured window, in mean repair times (the spec asks for >= 20)."""
    warmup_repairs: float = 5.0
    """Warm-up discarded before measuring, in mean repair times (the fleet starts all up)."""
    min_measure_s: float = 86400.0
    """Floor of the measured window, seconds (for very short repair times)."""
    measure_s: float | None = None
    """Measured window in seconds; overrides ``measure_repairs`` when set (the calibration
    fixes it so that the objective does not jump when the repair time moves)."""
    warmup_s: float | None = None
    """Warm-up in seconds; overrides ``warmup_repairs`` when set."""

    def __post_init__(self) -> None:
        if not isinstance(self.seeds, int) or self.seeds < 1:
            raise ConfigError(f"seeds = {self.seeds!r}: must be an integer >= 1")
        _positive("measure_repairs", self.measure_repairs)
        if self.warmup_repairs < 0:
            raise ConfigError(f"warmup_repairs = {self.warmup_repairs!r}: must be >= 0")
        if self.measure_s is not None:
            _positive("measure_s", self.measure_s)
        if self.warmup_s is not None and not self.warmup_s >= 0:
            raise ConfigError(f"warmup_s = {self.warmup_s!r}: must be >= 0")

    def window(self, failure: FailureModel) -> tuple[float, float]:
        """(warm-up, horizon) in seconds for this failure model."""
        mean_repair = failure.repair.mean
        warm = self.warmup_repairs * mean_repair if self.warmup_s is None else self.warmup_s
        measure = (
            max(self.measure_repairs * mean_repair, self.min_measure_s) if self.measure_s is None else self.measure_s
        )
        return warm, warm + measure


def check_chips(chips: int) -> int:
    """A positive integer chip count, or ConfigError naming it."""
    if isinstance(chips, bool) or not isinstance(chips, (int, float)) or chips != int(chips) or chips < 1:
        raise ConfigError(f"chips = {chips!r}: must be an integer >= 1")
    return int(chips)


def n_slices(chips: int, slice_chips: int) -> int:
    """Slices of a fleet: full slices plus one partial slice for the remainder."""
    return math.ceil(chips / slice_chips)


def check_fits(chips: int, failure: FailureModel, strategy: Strategy) -> None:
    """ConfigError when the strategy cannot be laid out on the fleet."""
    check_chips(chips)
    slices = n_slices(chips, failure.slice_chips)
    if strategy.learners > slices:
        raise ConfigError(
            f"learners (M) = {strategy.learners}: must be <= the number of "
            f"slices ({slices} = {chips} chips / {failure.slice_chips} per slice)"
        )


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} = {value!r}: must be a finite number > 0")
