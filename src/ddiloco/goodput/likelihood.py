"""The likelihood of the paper's rounded integers and the highest-posterior set it defines.

Each published goodput is the model's value plus a model error of ``tolerance`` points (sd),
rounded to an integer. The rounding error (uniform on +-0.5, variance 1/12) is folded into the
Gaussian, so the likelihood of a parameter set is ``exp(-SSE / (2 s^2))`` with
``s^2 = tolerance^2 + 1/12``: a function of its SSE only. Hence the ordering of points by
posterior weight (under a uniform prior) does not depend on the tolerance, and a larger
tolerance only flattens the weights: the highest-posterior set grows, nested, with it.
"""

from __future__ import annotations

import numpy as np

ROUNDING_VAR = 1.0 / 12.0
"""Variance of the error of rounding a value to an integer (uniform on +-0.5), points^2."""


def two_sigma2(tolerance: float) -> float:
    """2 s^2 of the Gaussian likelihood: model error plus rounding of the paper's integers."""
    return 2.0 * (tolerance**2 + ROUNDING_VAR)


def posterior(sse: np.ndarray, tolerance: float) -> np.ndarray:
    """Normalised posterior weight of each point (uniform prior over the points)."""
    w = np.exp(-(sse - sse.min()) / two_sigma2(tolerance))
    return w / w.sum()


def hpd_mask(sse: np.ndarray, tolerance: float, mass: float = 0.9) -> np.ndarray:
    """The fewest points (lowest SSE first) that hold ``mass`` of the posterior."""
    if not 0.0 < mass <= 1.0:
        raise ValueError(f"mass = {mass}: must be in (0, 1]")
    if sse.size == 0:
        return np.zeros(0, bool)
    order = np.argsort(sse, kind="stable")
    cum = np.cumsum(posterior(sse, tolerance)[order])
    n = int(np.searchsorted(cum, mass * (1 - 1e-12))) + 1  # first prefix reaching the mass
    mask = np.zeros(sse.size, bool)
    mask[order[: min(n, sse.size)]] = True
    return mask
