"""Run strategies over fleet sizes and seeds; summarise with 95% confidence intervals."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ddiloco.goodput.config import (
    CostModel,
    FailureModel,
    SimConfig,
    Strategy,
    check_chips,
    check_fits,
)
from ddiloco.goodput.strategies import CATEGORIES, Outcome, run_strategy
from ddiloco.goodput.timeline import make_timeline

PAPER_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
"""The fleet sizes of the paper's goodput table."""
DEFAULT_LEARNERS = (2, 4, 8, 16)
"""The Decoupled DiLoCo learner counts of the paper's grid."""

# Two-sided 95% Student t quantiles for 1..30 degrees of freedom (no scipy dependency).
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def t975(df: int) -> float:
    """Two-sided 95% Student t quantile."""
    if df < 1:
        return math.nan
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.4 / df


@dataclass(frozen=True)
class Stat:
    """Mean over seeds with a 95% confidence half-width."""

    mean: float
    """Mean over seeds."""
    ci95: float
    """Half-width of the 95% confidence interval of the mean (nan with one seed)."""

    @classmethod
    def of(cls, xs: Sequence[float]) -> Stat:
        a = np.asarray(xs, float)
        if a.size < 2:
            return cls(float(a.mean()), math.nan)
        return cls(float(a.mean()), t975(a.size - 1) * float(a.std(ddof=1)) / math.sqrt(a.size))


@dataclass(frozen=True)
class Cell:
    """One strategy at one fleet size, over all seeds."""

    chips: int
    """Fleet size."""
    strategy: Strategy
    """The strategy simulated."""
    goodput: Stat
    """Useful chip-time / allocated chip-time."""
    uptime: Stat
    """Share of time the system as a whole advances."""
    shares: dict[str, float] = field(default_factory=dict)
    """Mean share of allocated chip-time per category (``CATEGORIES``)."""
    failures: float = 0.0
    """Mean slice failures per seed in the measured window."""

    def to_json(self) -> dict:
        return {
            "chips": self.chips,
            "strategy": self.strategy.name,
            "kind": self.strategy.kind,
            "learners": self.strategy.learners,
            "quorum": self.strategy.quorum,
            "goodput": self.goodput.mean,
            "goodput_ci95": self.goodput.ci95,
            "uptime": self.uptime.mean,
            "uptime_ci95": self.uptime.ci95,
            "shares": self.shares,
            "failures_per_seed": self.failures,
        }


def default_strategies(learners: Iterable[int] = DEFAULT_LEARNERS, quorum: int = 1) -> list[Strategy]:
    """DP, elastic DP, and Decoupled DiLoCo for each M (quorum K capped at M)."""
    return [Strategy("dp"), Strategy("elastic")] + [
        Strategy("decoupled", learners=m, quorum=min(quorum, m)) for m in learners
    ]


def simulate_grid(
    chips: Iterable[int],
    strategies: Sequence[Strategy],
    failure: FailureModel | None = None,
    costs: CostModel | None = None,
    sim: SimConfig | None = None,
) -> list[Cell]:
    """Every strategy at every fleet size, each seed's timeline shared by all strategies."""
    failure = failure or FailureModel()
    costs = costs or CostModel()
    sim = sim or SimConfig()
    sizes = [check_chips(n) for n in chips]
    if not sizes:
        raise ValueError("chips: need at least one fleet size")
    for n in sizes:
        for s in strategies:
            check_fits(n, failure, s)
    cells: list[Cell] = []
    for n in sizes:
        runs: list[list[Outcome]] = [[] for _ in strategies]
        for i in range(sim.seeds):
            tl = make_timeline(n, sim.seed + i, failure, costs, sim)
            for j, s in enumerate(strategies):
                runs[j].append(run_strategy(tl, s, costs))
        for s, outs in zip(strategies, runs):
            cells.append(
                Cell(
                    chips=n,
                    strategy=s,
                    goodput=Stat.of([o.goodput for o in outs]),
                    uptime=Stat.of([o.uptime for o in outs]),
                    shares={c: float(np.mean([o.chip_time[c] / o.allocated for o in outs])) for c in CATEGORIES},
                    failures=float(np.mean([o.failures for o in outs])),
                )
            )
    return cells


def lookup(cells: Sequence[Cell], chips: int, name: str) -> Cell:
    """The cell of this fleet size and strategy name."""
    for c in cells:
        if c.chips == chips and c.strategy.name == name:
            return c
    raise KeyError(f"no cell for {name} at {chips} chips")
