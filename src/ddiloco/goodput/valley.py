"""Map the valley: every parameter set on a log grid, scored against the data-parallel rows.

The ten data-parallel cells do not pin the failure model down (repair time and pause length
trade off), so instead of one least-squares point we evaluate a grid over the whole prior box
and keep every cell's simulated goodput. The model factorises, which keeps this cheap:

- the non-elastic row depends on (recovery shape, restart mean) only: a 2-D grid;
- the elastic row and every Decoupled DiLoCo cell depend on (shape, pause, repair): a 3-D grid.

A 4-D parameter set is one point of each grid with the same shape; its SSE is the sum of the
two rows' SSEs. Every evaluation reuses the same seeds (common random numbers), so the SSE
surface is smooth and differences between grid points are not sampling noise. Decoupled
DiLoCo predictions, the expensive part, are simulated only for the (shape, pause, repair)
points that can enter the consistent set at the largest tolerance (see ``bands``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np

from ddiloco.goodput.calibrate import PAPER_DP, PAPER_ELASTIC, models_from
from ddiloco.goodput.config import SimConfig, Strategy
from ddiloco.goodput.likelihood import hpd_mask, two_sigma2
from ddiloco.goodput.simulate import DEFAULT_LEARNERS, PAPER_CHIPS, simulate_grid

log = logging.getLogger(__name__)


def log_axis(lo: float, hi: float, n: int) -> tuple[float, ...]:
    """``n`` values from ``lo`` to ``hi``, evenly spaced in log, four significant digits."""
    return tuple(float(f"{v:.4g}") for v in np.geomspace(lo, hi, n))


def band_strategies(learners: Sequence[int] = DEFAULT_LEARNERS) -> list[Strategy]:
    """The Decoupled DiLoCo cells of the grid: each M with K = 1 and with K = M / 2."""
    out: list[Strategy] = []
    for m in learners:
        for k in dict.fromkeys((1, max(1, m // 2))):
            out.append(Strategy("decoupled", m, k))
    return out


@dataclass(frozen=True)
class ValleyConfig:
    """The prior box, its grid, and how each grid point is simulated."""

    shapes: tuple[float, ...] = tuple(round(0.55 + 0.05 * i, 2) for i in range(12))
    """Weibull shape of restarts and pauses (shared), linear grid."""
    restart_s: tuple[float, ...] = log_axis(55.0, 180.0, 31)
    """Mean non-elastic restart, seconds (log grid)."""
    pause_s: tuple[float, ...] = log_axis(6.5, 16.0, 14)
    """Mean elastic reconfiguration pause (downscale = upscale), seconds (log grid)."""
    repair_s: tuple[float, ...] = log_axis(360.0, 21600.0, 11)
    """Mean slice repair time, seconds (log grid: 6 min to 6 h)."""
    chips: tuple[int, ...] = PAPER_CHIPS
    """Fleet sizes of the observed and predicted cells."""
    learners: tuple[int, ...] = DEFAULT_LEARNERS
    """Decoupled DiLoCo M of the predicted cells (each with K = 1 and K = M / 2)."""
    seeds: int = 4
    """Seeds per cell, the same at every grid point (common random numbers)."""
    seed: int = 0
    """First seed."""
    warmup_s: float = 12 * 3600.0
    """Discarded warm-up, seconds; fixed so the objective does not jump with the repair time
    (two mean repairs at the box's longest)."""
    measure_s: float = 48 * 3600.0
    """Measured window, seconds."""
    max_tolerance: float = 2.0
    """Largest model error (points) bands will be asked for; predictions are simulated for
    every point consistent at this tolerance, which covers all smaller ones (nested sets)."""
    mass: float = 0.9
    """Posterior mass of the consistent set."""
    shape_cut: float = 6.0
    """A shape whose best non-elastic SSE alone is more than this many units of 2 s^2 (at the
    largest tolerance) above the best is not explored on the elastic side: its weight is below
    e^-cut of the best point's."""

    def sim(self) -> SimConfig:
        return SimConfig(seeds=self.seeds, seed=self.seed, warmup_s=self.warmup_s, measure_s=self.measure_s)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> ValleyConfig:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


@dataclass
class ValleyMap:
    """Simulated goodput (%) at every evaluated grid point; NaN where not evaluated."""

    config: ValleyConfig
    """The grid and simulation settings."""
    target_dp: tuple[float, ...]
    """Observed non-elastic goodput (%) per fleet size."""
    target_elastic: tuple[float, ...]
    """Observed elastic goodput (%) per fleet size."""
    dp: np.ndarray
    """[shape, restart, chips]: non-elastic goodput."""
    elastic: np.ndarray
    """[shape, pause, repair, chips]: elastic goodput."""
    predicted: np.ndarray
    """[shape, pause, repair, strategy, chips]: Decoupled DiLoCo goodput (``strategies``)."""
    strategies: list[Strategy] = field(default_factory=list)
    """The predicted strategies, in the order of ``predicted``'s axis."""
    evals: dict[str, int] = field(default_factory=dict)
    """Grid points simulated per stage."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time per stage."""

    @property
    def sse_dp(self) -> np.ndarray:
        """[shape, restart]: SSE of the non-elastic row (inf where not evaluated)."""
        return _sse(self.dp, self.target_dp)

    @property
    def sse_elastic(self) -> np.ndarray:
        """[shape, pause, repair]: SSE of the elastic row (inf where not evaluated)."""
        return _sse(self.elastic, self.target_elastic)

    def joint_sse(self) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """SSE of every evaluated 4-D point and its grid indices (shape, restart, pause,
        repair)."""
        tot = self.sse_dp[:, :, None, None] + self.sse_elastic[:, None, :, :]
        ok = np.isfinite(tot)
        return tot[ok], tuple(a for a in np.nonzero(ok))

    def to_json(self) -> dict:
        pts = np.argwhere(~np.isnan(self.predicted[..., 0, 0]))
        return {
            "config": self.config.to_json(),
            "target_dp": list(self.target_dp),
            "target_elastic": list(self.target_elastic),
            "strategies": [[s.learners, s.quorum] for s in self.strategies],
            "dp": _nested(self.dp),
            "elastic": _nested(self.elastic),
            "predicted": [{"index": [int(x) for x in p], "goodput": _nested(self.predicted[tuple(p)])} for p in pts],
            "evals": self.evals,
            "seconds": self.seconds,
        }

    @classmethod
    def from_json(cls, d: dict) -> ValleyMap:
        cfg = ValleyConfig.from_json(d["config"])
        strategies = [Strategy("decoupled", m, k) for m, k in d["strategies"]]
        pred = np.full((len(cfg.shapes), len(cfg.pause_s), len(cfg.repair_s), len(strategies), len(cfg.chips)), np.nan)
        for p in d["predicted"]:
            pred[tuple(p["index"])] = _array(p["goodput"])
        return cls(
            cfg,
            tuple(d["target_dp"]),
            tuple(d["target_elastic"]),
            _array(d["dp"]),
            _array(d["elastic"]),
            pred,
            strategies,
            dict(d.get("evals", {})),
            dict(d.get("seconds", {})),
        )


def load_map(path: str) -> ValleyMap:
    """A map saved as JSON: ``ValleyMap.to_json()`` itself, or bench/goodput.py's results file
    (which holds it under ``valley.map``)."""
    with open(path) as fh:
        d = json.load(fh)
    if "valley" in d:
        d = d["valley"]["map"]
    return ValleyMap.from_json(d)


def _sse(means: np.ndarray, target: Sequence[float]) -> np.ndarray:
    s = np.sum((means - np.asarray(target, float)) ** 2, axis=-1)
    return np.where(np.isnan(s), np.inf, s)


def _nested(a: np.ndarray) -> list:
    # JSON has no NaN: unevaluated points are null. Six decimals keep the set's borders exact.
    return [_nested(x) for x in a] if a.ndim > 1 else [None if math.isnan(v) else round(float(v), 6) for v in a]


def _array(x: list) -> np.ndarray:
    return np.array(x, dtype=float)  # None -> nan


# ---- simulation of one grid point (top-level functions: picklable for worker processes) ----


def _params(shape: float, restart: float, pause: float, repair: float) -> dict[str, float]:
    return {"restart_mean_s": restart, "reconfig_mean_s": pause, "recovery_shape": shape, "repair_mean_s": repair}


def _goodput(cfg: ValleyConfig, params: dict[str, float], strategies: Sequence[Strategy]) -> list[list[float]]:
    """[strategy][chips] mean goodput, %."""
    cells = simulate_grid(cfg.chips, strategies, *models_from(params), cfg.sim())
    by = {(c.strategy, c.chips): 100.0 * c.goodput.mean for c in cells}
    return [[by[(s, n)] for n in cfg.chips] for s in strategies]


def _eval_dp(task: tuple[ValleyConfig, float, float]) -> list[float]:
    cfg, shape, restart = task
    # The non-elastic job sees every failure whatever the repair time (hot spares), and never
    # pauses: any pause and repair give the same result in distribution.
    return _goodput(cfg, _params(shape, restart, cfg.pause_s[0], cfg.repair_s[0]), [Strategy("dp")])[0]


def _eval_elastic(task: tuple[ValleyConfig, float, float, float]) -> list[float]:
    cfg, shape, pause, repair = task
    return _goodput(cfg, _params(shape, cfg.restart_s[0], pause, repair), [Strategy("elastic")])[0]


def _eval_predicted(task: tuple[ValleyConfig, float, float, float]) -> list[list[float]]:
    cfg, shape, pause, repair = task
    return _goodput(cfg, _params(shape, cfg.restart_s[0], pause, repair), band_strategies(cfg.learners))


def _pmap(fn: Callable, tasks: list, workers: int) -> list:
    if workers <= 1 or len(tasks) < 2:
        return [fn(t) for t in tasks]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, tasks, chunksize=max(1, len(tasks) // (8 * workers))))


# ---- the three stages ---------------------------------------------------------------------


def map_valley(
    cfg: ValleyConfig | None = None,
    target_dp: Sequence[float] | None = None,
    target_elastic: Sequence[float] | None = None,
    workers: int = 1,
) -> ValleyMap:
    """Simulate the grid (the paper's DP rows are the default targets); see the module doc."""
    cfg = cfg or ValleyConfig()
    t_dp = tuple(float(v) for v in (target_dp or [PAPER_DP[n] for n in cfg.chips]))
    t_el = tuple(float(v) for v in (target_elastic or [PAPER_ELASTIC[n] for n in cfg.chips]))
    if len(t_dp) != len(cfg.chips) or len(t_el) != len(cfg.chips):
        raise ValueError("targets: need one value per fleet size in config.chips")
    ns, nr, npause, nrep, nc = (
        len(cfg.shapes),
        len(cfg.restart_s),
        len(cfg.pause_s),
        len(cfg.repair_s),
        len(cfg.chips),
    )
    strategies = band_strategies(cfg.learners)
    vm = ValleyMap(
        cfg,
        t_dp,
        t_el,
        np.full((ns, nr, nc), np.nan),
        np.full((ns, npause, nrep, nc), np.nan),
        np.full((ns, npause, nrep, len(strategies), nc), np.nan),
        strategies,
    )

    # 1. Non-elastic row over (shape, restart).
    t0 = time.perf_counter()
    idx = [(i, j) for i in range(ns) for j in range(nr)]
    res = _pmap(_eval_dp, [(cfg, cfg.shapes[i], cfg.restart_s[j]) for i, j in idx], workers)
    for (i, j), r in zip(idx, res):
        vm.dp[i, j] = r
    vm.evals["dp"], vm.seconds["dp"] = len(idx), time.perf_counter() - t0

    # 2. Elastic row over (shape, pause, repair), for the shapes the first row leaves plausible.
    t0 = time.perf_counter()
    prof = vm.sse_dp.min(axis=1)
    keep = [i for i in range(ns) if prof[i] <= prof.min() + cfg.shape_cut * two_sigma2(cfg.max_tolerance)]
    log.info("valley: %d/%d shapes kept after the non-elastic row", len(keep), ns)
    idx3 = [(i, k, m) for i in keep for k in range(npause) for m in range(nrep)]
    res = _pmap(_eval_elastic, [(cfg, cfg.shapes[i], cfg.pause_s[k], cfg.repair_s[m]) for i, k, m in idx3], workers)
    for (i, k, m), r in zip(idx3, res):
        vm.elastic[i, k, m] = r
    vm.evals["elastic"], vm.seconds["elastic"] = len(idx3), time.perf_counter() - t0

    # 3. Decoupled DiLoCo at every (shape, pause, repair) consistent at the largest tolerance.
    t0 = time.perf_counter()
    sse, (si, _, pk, rm) = vm.joint_sse()
    inside = hpd_mask(sse, cfg.max_tolerance, cfg.mass)
    idx3 = sorted({(int(a), int(b), int(c)) for a, b, c in zip(si[inside], pk[inside], rm[inside])})
    res = _pmap(_eval_predicted, [(cfg, cfg.shapes[i], cfg.pause_s[k], cfg.repair_s[m]) for i, k, m in idx3], workers)
    for (i, k, m), r in zip(idx3, res):
        vm.predicted[i, k, m] = r
    vm.evals["predicted"], vm.seconds["predicted"] = len(idx3), time.perf_counter() - t0
    return vm
