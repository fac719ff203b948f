"""Least-squares calibration of the failure and recovery model to the paper's data-parallel rows.

Fitted (in log space, so every parameter stays positive): the mean non-elastic restart time,
the mean elastic reconfiguration pause (downscale = upscale), one shape shared by both (a
Weibull: recovery times of real fleets are heavy-tailed), and the mean slice repair time.
Fixed: MTBI (1 year, the paper's), slice size, step time and checkpoint interval (see config).
Only data-parallel cells enter the objective: the Decoupled DiLoCo grid is then predicted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from ddiloco.chaos import Exponential, Weibull
from ddiloco.goodput.config import CostModel, FailureModel, SimConfig, Strategy
from ddiloco.goodput.fit import nelder_mead
from ddiloco.goodput.simulate import PAPER_CHIPS, lookup, simulate_grid

PAPER_DP = dict(zip(PAPER_CHIPS, (72.0, 57.0, 38.0, 27.0, 18.0)))
"""Paper: goodput (%) of data-parallel, not elastic, MTBI 1 year."""
PAPER_ELASTIC = dict(zip(PAPER_CHIPS, (88.0, 80.0, 69.0, 58.0, 40.0)))
"""Paper: goodput (%) of elastic data-parallel, MTBI 1 year."""
PAPER_DDILOCO = {(8, 1_200_000): 88.0}
"""Paper: goodput (%) of Decoupled DiLoCo, M = 8, K = 1: the one published cell (not fitted)."""
FIT_WARMUP_S = 8 * 3600.0
FIT_MEASURE_S = 48 * 3600.0
FIT_START = {"restart_mean_s": 60.0, "reconfig_mean_s": 30.0, "recovery_shape": 1.0, "repair_mean_s": 3600.0}
"""Where the fit starts: round numbers, not the answer."""
PARAM_NAMES = ("restart_mean_s", "reconfig_mean_s", "recovery_shape", "repair_mean_s")


def models_from(
    params: dict[str, float], base_failure: FailureModel | None = None, base_costs: CostModel | None = None
) -> tuple[FailureModel, CostModel]:
    """The failure and cost models that a parameter set (as in ``CALIBRATED``) stands for."""
    f = replace(base_failure or FailureModel(), repair=Exponential(params["repair_mean_s"]))
    shape = params["recovery_shape"]
    reconfig = Weibull.from_mean(params["reconfig_mean_s"], shape)
    c = replace(
        base_costs or CostModel(),
        restart=Weibull.from_mean(params["restart_mean_s"], shape),
        downscale=reconfig,
        upscale=reconfig,
    )
    return f, c


@dataclass(frozen=True)
class Residual:
    """One fitted (or predicted) cell against the paper."""

    strategy: str
    """Strategy name."""
    chips: int
    """Fleet size."""
    paper: float
    """The paper's goodput, %."""
    model: float
    """The model's mean goodput, %."""
    ci95: float
    """95% confidence half-width of the model's mean, percentage points."""

    @property
    def residual(self) -> float:
        """Model minus paper, percentage points."""
        return self.model - self.paper


@dataclass(frozen=True)
class Calibration:
    """The result of a calibration run."""

    params: dict[str, float]
    """Fitted parameters (see ``PARAM_NAMES``)."""
    residuals: list[Residual]
    """The ten data-parallel cells, evaluated with ``check_seeds`` fresh seeds."""
    sse: float
    """Sum of squared residuals of the fit itself (fit seeds), points^2."""
    evals: int
    """Objective evaluations."""
    seconds: float
    """Wall time of the fit."""
    fit_seeds: int
    """Seeds per cell inside the objective (common random numbers across evaluations)."""
    fitted: tuple[str, ...] = PARAM_NAMES
    """The parameters that were free in the fit (the others were held fixed)."""

    @property
    def within3(self) -> int:
        return sum(abs(r.residual) <= 3.0 for r in self.residuals)

    @property
    def max_abs(self) -> float:
        return max(abs(r.residual) for r in self.residuals)


def dp_residuals(params: dict[str, float], sim: SimConfig, base_failure: FailureModel | None = None) -> list[Residual]:
    """Simulate the two data-parallel rows under ``params`` and compare with the paper."""
    failure, costs = models_from(params, base_failure)
    cells = simulate_grid(PAPER_CHIPS, [Strategy("dp"), Strategy("elastic")], failure, costs, sim)
    out = []
    for name, table in (("DP", PAPER_DP), ("elastic DP", PAPER_ELASTIC)):
        for n, paper in table.items():
            c = lookup(cells, n, name)
            out.append(Residual(name, n, paper, 100 * c.goodput.mean, 100 * c.goodput.ci95))
    return out


def calibrate(
    fit_seeds: int = 4,
    check_seeds: int = 20,
    x0: dict[str, float] | None = None,
    max_evals: int = 250,
    sim: SimConfig | None = None,
    base_failure: FailureModel | None = None,
    fixed: dict[str, float] | None = None,
) -> Calibration:
    """Fit ``PARAM_NAMES`` (less those in ``fixed``) by least squares on the ten DP cells.

    The objective reuses the same seeds at every evaluation (common random numbers), so it is
    a deterministic, nearly smooth function of the parameters; the residuals reported are then
    recomputed on ``check_seeds`` seeds that start after the fit seeds.
    """
    sim = sim or SimConfig()
    start = x0 or FIT_START
    fixed = fixed or {}
    free = [k for k in PARAM_NAMES if k not in fixed]
    # A fixed window (>= 20 mean repair times for repairs up to 2.4 h) keeps the objective
    # from jumping as the candidate repair time stretches or shrinks the horizon.
    fit_sim = replace(sim, seeds=fit_seeds, warmup_s=FIT_WARMUP_S, measure_s=FIT_MEASURE_S)

    def params_of(x: np.ndarray) -> dict[str, float]:
        return {**dict(zip(free, np.exp(x).tolist())), **fixed}

    def sse(x: np.ndarray) -> float:
        return float(sum(r.residual**2 for r in dp_residuals(params_of(x), fit_sim, base_failure)))

    t0 = time.perf_counter()
    res = nelder_mead(sse, np.log([start[k] for k in free]), step=0.25, max_evals=max_evals, xtol=2e-3, ftol=1e-3)
    seconds = time.perf_counter() - t0
    params = {k: float(f"{params_of(res.x)[k]:.4g}") for k in PARAM_NAMES}
    check = replace(sim, seeds=check_seeds, seed=sim.seed + 1000)
    return Calibration(
        params=params,
        residuals=dp_residuals(params, check, base_failure),
        sse=res.fun,
        evals=res.evals,
        seconds=seconds,
        fit_seeds=fit_seeds,
        fitted=tuple(free),
    )
