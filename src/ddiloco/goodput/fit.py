"""A small Nelder-Mead minimiser (the project has no scipy), for least-squares calibration."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FitResult:
    """Where the minimiser stopped."""

    x: np.ndarray
    """Best point found."""
    fun: float
    """Objective at ``x``."""
    evals: int
    """Objective evaluations used."""


def nelder_mead(
    fun: Callable[[np.ndarray], float],
    x0: np.ndarray,
    step: float | np.ndarray = 0.2,
    max_evals: int = 400,
    xtol: float = 1e-3,
    ftol: float = 1e-6,
) -> FitResult:
    """Minimise ``fun`` from ``x0`` with the standard simplex moves (Gao-Han adaptive
    coefficients, which behave better than the classic ones beyond a few dimensions)."""
    x0 = np.asarray(x0, float)
    n = x0.size
    alpha, gamma, rho, sigma = 1.0, 1.0 + 2.0 / n, 0.75 - 1.0 / (2 * n), 1.0 - 1.0 / n
    simplex = np.vstack([x0, x0 + np.diag(np.broadcast_to(step, (n,)))])
    values = np.array([fun(x) for x in simplex])
    evals = n + 1
    while evals < max_evals:
        order = np.argsort(values)
        simplex, values = simplex[order], values[order]
        if np.max(np.abs(simplex[1:] - simplex[0])) < xtol and values[-1] - values[0] < ftol:
            break
        centroid = simplex[:-1].mean(axis=0)
        xr = centroid + alpha * (centroid - simplex[-1])
        fr = fun(xr)
        evals += 1
        if fr < values[0]:
            xe = centroid + gamma * (xr - centroid)
            fe = fun(xe)
            evals += 1
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            outside = fr < values[-1]
            xc = centroid + rho * ((xr if outside else simplex[-1]) - centroid)
            fc = fun(xc)
            evals += 1
            if fc < (fr if outside else values[-1]):
                simplex[-1], values[-1] = xc, fc
            else:  # shrink towards the best point
                simplex[1:] = simplex[0] + sigma * (simplex[1:] - simplex[0])
                values[1:] = [fun(x) for x in simplex[1:]]
                evals += n
    best = int(np.argmin(values))
    return FitResult(x=simplex[best].copy(), fun=float(values[best]), evals=evals)
