"""From a valley map to the consistent set, prediction bands and the default calibration.

Likelihood: see ``likelihood`` (Gaussian model error of ``tolerance`` points plus rounding).
Prior: uniform over the grid (log-uniform means, uniform shape, inside the box of
``ValleyConfig``). The **consistent set** is the 90% highest-posterior set: the fewest grid
points that hold 90% of the posterior; it only grows with the tolerance (nested).

A cell's **band** is the range of its prediction over the consistent set (so it holds at least
90% of the posterior predictive mass, and is nested as the set is); its **median** is the
posterior-weighted median over the set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ddiloco.goodput.config import Strategy
from ddiloco.goodput.likelihood import hpd_mask, posterior
from ddiloco.goodput.valley import ValleyMap

PARAMS = ("recovery_shape", "restart_mean_s", "reconfig_mean_s", "repair_mean_s")
"""Order of the four grid axes (shape, restart, pause, repair)."""


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cum, 0.5 * cum[-1])])


@dataclass(frozen=True)
class Band:
    """A cell's prediction over the consistent set, goodput %."""

    median: float
    """Posterior-weighted median."""
    lo: float
    """Lowest prediction in the consistent set."""
    hi: float
    """Highest prediction in the consistent set."""

    def to_json(self) -> dict:
        return {"median": self.median, "lo": self.lo, "hi": self.hi}


@dataclass(frozen=True)
class ConsistentSet:
    """The consistent grid points at one tolerance, with their posterior weights."""

    tolerance: float
    """Model error, points (sd)."""
    mass: float
    """Posterior mass the set holds."""
    index: tuple[np.ndarray, ...]
    """Grid indices (shape, restart, pause, repair) of each member."""
    sse: np.ndarray
    """SSE of each member, points^2."""
    weight: np.ndarray
    """Posterior weight of each member, renormalised within the set."""
    grid_points: int
    """4-D grid points evaluated (the set is drawn from these)."""

    @property
    def size(self) -> int:
        return int(self.sse.size)


def consistent_set(vm: ValleyMap, tolerance: float = 1.5, mass: float | None = None) -> ConsistentSet:
    """The consistent set of ``vm`` at ``tolerance`` (points of model error)."""
    mass = vm.config.mass if mass is None else mass
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance = {tolerance}: must be >= 0")
    sse, idx = vm.joint_sse()
    if sse.size == 0:
        raise ValueError("the valley map has no evaluated point")
    m = hpd_mask(sse, tolerance, mass)
    w = posterior(sse, tolerance)[m]
    return ConsistentSet(tolerance, mass, tuple(a[m] for a in idx), sse[m], w / w.sum(), int(sse.size))


def member_params(vm: ValleyMap, cs: ConsistentSet) -> dict[str, np.ndarray]:
    """Parameter values of each member, by name (see ``PARAMS``)."""
    c = vm.config
    axes = (c.shapes, c.restart_s, c.pause_s, c.repair_s)
    return {name: np.asarray(ax, float)[i] for name, ax, i in zip(PARAMS, axes, cs.index)}


def cell_values(vm: ValleyMap, cs: ConsistentSet, name: str, chips: int) -> np.ndarray:
    """Prediction (%) of one cell (strategy name, fleet size) at each member of the set."""
    si, ri, pi, mi = cs.index
    c = vm.config.chips.index(chips)
    if name == "DP":
        v = vm.dp[si, ri, c]
    elif name == "elastic DP":
        v = vm.elastic[si, pi, mi, c]
    else:
        k = [s.name for s in vm.strategies].index(name)
        v = vm.predicted[si, pi, mi, k, c]
    if np.isnan(v).any():
        raise ValueError(
            f"{name} at {chips} chips: not simulated at every member; map the "
            f"valley with max_tolerance >= {cs.tolerance}"
        )
    return v


def strategy_names(vm: ValleyMap) -> list[str]:
    return ["DP", "elastic DP"] + [s.name for s in vm.strategies]


def bands(vm: ValleyMap, cs: ConsistentSet) -> dict[tuple[str, int], Band]:
    """Median and range over the consistent set, for every cell of the map."""
    out = {}
    for name in strategy_names(vm):
        for n in vm.config.chips:
            v = cell_values(vm, cs, name, n)
            out[(name, n)] = Band(weighted_median(v, cs.weight), float(v.min()), float(v.max()))
    return out


def spread(vm: ValleyMap, cs: ConsistentSet) -> dict[str, dict[str, float | bool]]:
    """Per parameter: weighted median, min, max over the set, and whether it reaches the box
    edge (then the data do not bound it there: the prior box does)."""
    out: dict[str, dict[str, float | bool]] = {}
    c = vm.config
    axes = dict(zip(PARAMS, (c.shapes, c.restart_s, c.pause_s, c.repair_s)))
    for name, v in member_params(vm, cs).items():
        ax = axes[name]
        out[name] = {
            "median": weighted_median(v, cs.weight),
            "min": float(v.min()),
            "max": float(v.max()),
            "at_lower_edge": bool(len(ax) > 1 and v.min() <= ax[0]),
            "at_upper_edge": bool(len(ax) > 1 and v.max() >= ax[-1]),
        }
    return out


def median_member(vm: ValleyMap, cs: ConsistentSet, strategies: list[Strategy] | None = None) -> dict[str, float]:
    """The default calibration: the member of the set whose Decoupled DiLoCo predictions are
    closest (least squares over all those cells) to the bands' medians. Ties go to the lower
    SSE."""
    names = [s.name for s in (strategies or vm.strategies)]
    b = bands(vm, cs)
    dist = np.zeros(cs.size)
    for name in names:
        for n in vm.config.chips:
            dist += (cell_values(vm, cs, name, n) - b[(name, n)].median) ** 2
    best = int(np.lexsort((cs.sse, dist))[0])
    return {k: float(v[best]) for k, v in member_params(vm, cs).items()}


def valley_points(
    vm: ValleyMap, cs: ConsistentSet
) -> tuple[dict[str, list[float]], dict[tuple[str, int], list[float]]]:
    """The set's distinct (shape, pause, repair) points, with their summed posterior weight
    (over restarts), and each Decoupled DiLoCo cell's prediction there (``plot_valley``'s
    input)."""
    si, _, pi, mi = cs.index
    keys = sorted(set(zip(si.tolist(), pi.tolist(), mi.tolist())))
    pos = {k: n for n, k in enumerate(keys)}
    weight = np.zeros(len(keys))
    np.add.at(weight, [pos[k] for k in zip(si.tolist(), pi.tolist(), mi.tolist())], cs.weight)
    c = vm.config
    points = {
        "recovery_shape": [c.shapes[k[0]] for k in keys],
        "reconfig_mean_s": [c.pause_s[k[1]] for k in keys],
        "repair_mean_s": [c.repair_s[k[2]] for k in keys],
        "weight": weight.tolist(),
    }
    preds = {
        (s.name, n): [float(vm.predicted[i, p, m, j, ci]) for i, p, m in keys]
        for j, s in enumerate(vm.strategies)
        for ci, n in enumerate(c.chips)
    }
    return points, preds
