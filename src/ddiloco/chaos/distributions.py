"""Duration distributions and Poisson failure sampling: the failure vocabulary shared by the
training runtimes' chaos schedules and the datacenter goodput simulator.

Everything here is pure: a ``numpy.random.Generator`` is passed in, nothing reads a global RNG.
Durations are in seconds. Config strings (``parse_distribution``, ``parse_duration``) accept
unit suffixes ``ms s m h d w y`` so a CLI can say ``exponential:2h`` or ``--mtbi 1y``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from ddiloco.errors import ConfigError

__all__ = [
    "Distribution",
    "Fixed",
    "Exponential",
    "Weibull",
    "parse_distribution",
    "parse_duration",
    "format_duration",
    "poisson_failure_times",
    "failure_repair_cycles",
    "repair_mask",
    "unit_failures",
]

SECONDS_PER_YEAR = 365.25 * 86400.0
_UNITS = {
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "min": 60.0,
    "h": 3600.0,
    "d": 86400.0,
    "w": 7 * 86400.0,
    "y": SECONDS_PER_YEAR,
}


@runtime_checkable
class Distribution(Protocol):
    """A non-negative duration distribution in seconds."""

    @property
    def mean(self) -> float: ...

    def sample(self, rng: np.random.Generator, size: int | tuple[int, ...] | None = None) -> float | np.ndarray: ...

    def spec(self) -> str: ...


def _check_positive(field: str, value: float, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not (ok and math.isfinite(value)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{field} = {value!r}: must be a finite number {bound}")


@dataclass(frozen=True)
class Fixed:
    """Always the same duration."""

    seconds: float
    """The duration, in seconds (>= 0)."""

    def __post_init__(self) -> None:
        _check_positive("fixed.seconds", self.seconds, allow_zero=True)

    @property
    def mean(self) -> float:
        return float(self.seconds)

    def sample(self, rng: np.random.Generator, size: int | tuple[int, ...] | None = None) -> float | np.ndarray:
        # Draw nothing: a Fixed duration must not shift the generator's stream.
        return float(self.seconds) if size is None else np.full(size, float(self.seconds))

    def spec(self) -> str:
        return f"fixed:{format_duration(self.seconds)}"


@dataclass(frozen=True)
class Exponential:
    """Memoryless durations (the classic repair/failure model)."""

    mean_s: float
    """Mean duration, in seconds (> 0)."""

    def __post_init__(self) -> None:
        _check_positive("exponential.mean", self.mean_s)

    @property
    def mean(self) -> float:
        return float(self.mean_s)

    def sample(self, rng: np.random.Generator, size: int | tuple[int, ...] | None = None) -> float | np.ndarray:
        # Scale a standard draw so that the same seed gives durations proportional to the mean
        # (common random numbers: a fit sees a smooth objective).
        x = rng.standard_exponential(size)
        return float(x) * self.mean_s if size is None else x * self.mean_s

    def spec(self) -> str:
        return f"exponential:{format_duration(self.mean_s)}"


@dataclass(frozen=True)
class Weibull:
    """Weibull durations; shape < 1 is heavy-tailed (most are short, a few are very long)."""

    shape: float
    """Shape k (> 0): 1 is exponential, < 1 heavier tail, > 1 more regular."""
    scale: float
    """Scale lambda in seconds (> 0); mean = scale * Gamma(1 + 1/shape)."""

    def __post_init__(self) -> None:
        _check_positive("weibull.shape", self.shape)
        _check_positive("weibull.scale", self.scale)

    @classmethod
    def from_mean(cls, mean: float, shape: float) -> Weibull:
        """The Weibull with this mean (seconds) and shape."""
        _check_positive("weibull.mean", mean)
        _check_positive("weibull.shape", shape)
        return cls(shape=shape, scale=mean / math.gamma(1.0 + 1.0 / shape))

    @property
    def mean(self) -> float:
        return self.scale * math.gamma(1.0 + 1.0 / self.shape)

    def sample(self, rng: np.random.Generator, size: int | tuple[int, ...] | None = None) -> float | np.ndarray:
        # Inverse transform of a standard exponential: smooth in shape and scale for a fixed seed.
        x = rng.standard_exponential(size) ** (1.0 / self.shape) * self.scale
        return float(x) if size is None else x

    def spec(self) -> str:
        return f"weibull:{format_duration(self.mean)},shape={self.shape:g}"


def parse_duration(text: str | float | int, field: str = "duration") -> float:
    """Seconds from ``"90"``, ``"90s"``, ``"2.5h"``, ``"1y"`` (or a number); ConfigError if bad."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([-+0-9.eE]+)\s*([a-z]*)\s*", str(text))
        if m is None or m.group(2) not in ("", *_UNITS):
            raise ConfigError(
                f"{field} = {text!r}: expected a number with an optional unit "
                f"({', '.join(_UNITS)}), e.g. '90s' or '2h'"
            )
        try:
            value = float(m.group(1)) * _UNITS.get(m.group(2) or "s", 1.0)
        except ValueError:
            raise ConfigError(f"{field} = {text!r}: not a number") from None
    if not math.isfinite(value):
        raise ConfigError(f"{field} = {text!r}: must be finite")
    return value


def format_duration(seconds: float) -> str:
    """A short, parseable form: ``90s``, ``2h``, ``1.5d``."""
    for unit, mult in (("y", SECONDS_PER_YEAR), ("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        # A larger unit only when it reads exactly (2h, 1.5d), never as 1.547m.
        if seconds >= mult and abs(seconds / mult - round(seconds / mult, 1)) < 1e-9:
            return f"{seconds / mult:g}{unit}"
    return f"{seconds:.6g}s"


def parse_distribution(text: str, field: str = "distribution") -> Distribution:
    """Parse ``fixed:30s``, ``exponential:2h`` (``exp:``), ``weibull:90s,shape=0.8`` or
    ``weibull:scale=80s,shape=0.8``; a bare duration means fixed. ConfigError names ``field``."""
    kind, _, rest = str(text).strip().partition(":")
    kind = kind.lower()
    if not rest:
        return Fixed(parse_duration(kind, field))
    pos: list[str] = []
    kw: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, val = part.partition("=")
        if eq:
            kw[key.strip().lower()] = val
        else:
            pos.append(part)
    try:
        if kind == "fixed" and len(pos) == 1 and not kw:
            return Fixed(parse_duration(pos[0], field))
        if kind in ("exponential", "exp") and len(pos) + len(kw) == 1:
            return Exponential(parse_duration(pos[0] if pos else kw["mean"], field))
        if kind == "weibull" and "shape" in kw:
            shape = float(kw["shape"])
            if len(pos) == 1 and set(kw) == {"shape"}:
                return Weibull.from_mean(parse_duration(pos[0], field), shape)
            if not pos and set(kw) == {"shape", "mean"}:
                return Weibull.from_mean(parse_duration(kw["mean"], field), shape)
            if not pos and set(kw) == {"shape", "scale"}:
                return Weibull(shape=shape, scale=parse_duration(kw["scale"], field))
    except ConfigError as exc:
        raise ConfigError(f"{field} = {text!r}: {exc}") from None
    except (KeyError, ValueError):
        pass  # fall through to the one message that shows every accepted form
    raise ConfigError(
        f"{field} = {text!r}: expected fixed:DUR, exponential:MEAN, "
        f"weibull:MEAN,shape=K or weibull:scale=DUR,shape=K"
    )


def poisson_failure_times(
    rng: np.random.Generator, rate_per_s: float, horizon_s: float, start_s: float = 0.0
) -> np.ndarray:
    """Sorted event times of a homogeneous Poisson process on [start_s, start_s + horizon_s).

    Draws the count first, then uniform times: exact, vectorised, and cheap for millions.
    """
    _check_positive("rate_per_s", rate_per_s, allow_zero=True)
    _check_positive("horizon_s", horizon_s, allow_zero=True)
    n = rng.poisson(rate_per_s * horizon_s)
    return start_s + np.sort(rng.uniform(0.0, horizon_s, size=n))


def unit_failures(rng: np.random.Generator, rates_per_s: np.ndarray, horizon_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Independent Poisson failures of many units (chips, slices, learners) on [0, horizon_s).

    Unit u fails at ``rates_per_s[u]`` whether or not it is already down; ``repair_mask``
    removes the failures a unit cannot have while in repair. Returns ``(unit, t)`` sorted by
    unit, then time.
    """
    rates = np.asarray(rates_per_s, dtype=float)
    if rates.ndim != 1 or np.any(rates < 0) or not np.all(np.isfinite(rates)):
        raise ConfigError("rates_per_s: must be a 1-D array of finite rates >= 0")
    _check_positive("horizon_s", horizon_s, allow_zero=True)
    counts = rng.poisson(rates * horizon_s)
    unit = np.repeat(np.arange(rates.size), counts)
    t = rng.uniform(0.0, horizon_s, size=unit.size)
    order = np.lexsort((t, unit))
    return unit[order], t[order]


def repair_mask(unit: np.ndarray, t: np.ndarray, repair_s: np.ndarray) -> np.ndarray:
    """Which failures hit a unit that is up: a failure at ``t`` takes its unit down until
    ``t + repair_s``, and failures of that unit before then are dropped.

    ``unit``/``t`` sorted by unit, then time (as ``unit_failures`` returns them). Thinning a
    Poisson process this way gives exactly "fails at its rate while up" (memorylessness).
    Vectorised across units; the loop runs over the k-th failure of every unit at once.
    """
    n = unit.size
    if n == 0:
        return np.zeros(0, bool)
    first = np.r_[True, unit[1:] != unit[:-1]]
    start = np.flatnonzero(first)
    row = np.cumsum(first) - 1  # dense index of the unit
    rank = np.arange(n) - start[row]  # k-th failure of its unit
    times = np.full((start.size, int(rank.max()) + 1), np.inf)
    ends = np.full_like(times, np.inf)
    times[row, rank] = t
    ends[row, rank] = t + repair_s
    back = np.full(start.size, -np.inf)  # when each unit is next up
    kept = np.zeros_like(times, dtype=bool)
    for k in range(times.shape[1]):
        hit = times[:, k] >= back
        kept[:, k] = hit & np.isfinite(times[:, k])
        back = np.where(kept[:, k], ends[:, k], back)
    return kept[row, rank]


def failure_repair_cycles(
    rng: np.random.Generator, rates_per_s: np.ndarray, repair: Distribution, horizon_s: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Alternating up/down cycles of many independent units (e.g. learners in a chaos run).

    Unit u fails at ``rates_per_s[u]`` while up, then is down for a ``repair`` draw; all start
    up at t = 0. Returns ``(unit, fail_t, return_t)`` for every failure before ``horizon_s``,
    sorted by failure time; ``return_t`` may lie beyond the horizon.
    """
    unit, t = unit_failures(rng, rates_per_s, horizon_s)
    rep = np.asarray(repair.sample(rng, unit.size), dtype=float)
    kept = repair_mask(unit, t, rep)
    order = np.argsort(t[kept], kind="stable")
    return unit[kept][order], t[kept][order], (t + rep)[kept][order]
