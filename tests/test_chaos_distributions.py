"""The shared failure vocabulary: distributions, parsers, Poisson and failure/repair sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.chaos import (
    SECONDS_PER_YEAR,
    Distribution,
    Exponential,
    Fixed,
    Weibull,
    failure_repair_cycles,
    format_duration,
    parse_distribution,
    parse_duration,
    poisson_failure_times,
    repair_mask,
    unit_failures,
)
from ddiloco.errors import ConfigError


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.mark.parametrize(
    "dist", [Fixed(30.0), Exponential(30.0), Weibull.from_mean(30.0, 0.7), Weibull.from_mean(30.0, 3.0)]
)
def test_sample_mean_matches_mean(dist: Distribution) -> None:
    assert isinstance(dist, Distribution)
    assert dist.mean == pytest.approx(30.0)
    x = dist.sample(rng(), 200_000)
    assert x.shape == (200_000,) and np.all(x >= 0)
    assert x.mean() == pytest.approx(30.0, rel=0.02)


def test_scalar_and_shaped_samples() -> None:
    for dist in (Fixed(2.0), Exponential(2.0), Weibull(shape=1.5, scale=2.0)):
        assert isinstance(dist.sample(rng()), float)
        assert dist.sample(rng(), (3, 4)).shape == (3, 4)


def test_same_seed_same_samples_and_fixed_draws_nothing() -> None:
    d = Weibull.from_mean(10.0, 0.8)
    assert np.array_equal(d.sample(rng(5), 10), d.sample(rng(5), 10))
    g = rng(1)
    Fixed(3.0).sample(g, 10)
    assert g.random() == rng(1).random()  # Fixed did not consume the stream


def test_weibull_shape_one_is_exponential_and_scales_with_mean() -> None:
    w = Weibull.from_mean(5.0, 1.0)
    assert w.scale == pytest.approx(5.0)
    assert np.allclose(w.sample(rng(2), 5), Exponential(5.0).sample(rng(2), 5))
    # Common random numbers: the same seed gives durations proportional to the mean.
    assert np.allclose(
        Weibull.from_mean(10.0, 0.8).sample(rng(3), 5), 2 * Weibull.from_mean(5.0, 0.8).sample(rng(3), 5)
    )
    assert Weibull(shape=2.0, scale=1.0).mean == pytest.approx(math.sqrt(math.pi) / 2)


@pytest.mark.parametrize(
    "text,seconds",
    [
        ("90", 90.0),
        ("90s", 90.0),
        ("1.5m", 90.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        ("250ms", 0.25),
        ("1y", SECONDS_PER_YEAR),
        (12, 12.0),
    ],
)
def test_parse_duration(text: str | int, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


def test_parse_distribution_forms_and_round_trip() -> None:
    assert parse_distribution("fixed:30") == Fixed(30.0)
    assert parse_distribution("45m") == Fixed(2700.0)
    assert parse_distribution("exponential:2h") == Exponential(7200.0)
    assert parse_distribution("exp:mean=10") == Exponential(10.0)
    assert parse_distribution("weibull:90s,shape=0.8").mean == pytest.approx(90.0)
    assert parse_distribution("weibull:mean=90,shape=0.8").mean == pytest.approx(90.0)
    assert parse_distribution("weibull:scale=80,shape=0.5") == Weibull(shape=0.5, scale=80.0)
    for d in (Fixed(12.0), Exponential(7200.0), Weibull.from_mean(95.0, 0.84)):
        assert parse_distribution(d.spec()).mean == pytest.approx(d.mean, rel=1e-5)
    assert format_duration(7200.0) == "2h"


@pytest.mark.parametrize(
    "text", ["weibull:90", "gamma:3", "exp:-3", "exp:3x", "fixed:", "weibull:90,shape=-1", "exp:1,2"]
)
def test_parse_distribution_errors_name_the_field(text: str) -> None:
    with pytest.raises(ConfigError, match="repair"):
        parse_distribution(text, "repair")


@pytest.mark.parametrize(
    "bad",
    [
        lambda: Fixed(-1.0),
        lambda: Exponential(0.0),
        lambda: Weibull(shape=0.0, scale=1.0),
        lambda: Weibull.from_mean(float("nan"), 1.0),
        lambda: parse_duration("abc"),
        lambda: parse_duration("inf"),
    ],
)
def test_bad_values_raise_config_error(bad) -> None:
    with pytest.raises(ConfigError):
        bad()


def test_poisson_failure_times() -> None:
    t = poisson_failure_times(rng(0), 0.5, 1000.0, start_s=10.0)
    assert np.all(np.diff(t) >= 0) and t.min() >= 10.0 and t.max() < 1010.0
    counts = [poisson_failure_times(rng(s), 0.5, 1000.0).size for s in range(200)]
    assert np.mean(counts) == pytest.approx(500, rel=0.02)
    assert poisson_failure_times(rng(0), 0.0, 1000.0).size == 0
    assert np.array_equal(t, poisson_failure_times(rng(0), 0.5, 1000.0, start_s=10.0))


def test_failure_repair_cycles_rate_counts_only_up_time() -> None:
    # Up mean 100 s, down exactly 100 s: half the time down, so half the naive failure count.
    rates = np.full(2000, 0.01)
    unit, f, r = failure_repair_cycles(rng(0), rates, Fixed(100.0), 10_000.0)
    assert np.allclose(r - f, 100.0)
    assert f.size / 2000 == pytest.approx(10_000 * 0.01 / 2, rel=0.03)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(1e-4, 0.2), min_size=1, max_size=20), st.floats(1.0, 50.0), st.integers(0, 2**31 - 1))
def test_failure_repair_cycles_alternate(rates: list[float], repair: float, seed: int) -> None:
    horizon = 500.0
    unit, f, r = failure_repair_cycles(rng(seed), np.array(rates), Exponential(repair), horizon)
    assert np.all(np.diff(f) >= 0) and np.all(f < horizon) and np.all(r > f)
    for u in range(len(rates)):
        fu, ru = f[unit == u], r[unit == u]
        assert np.all(fu[1:] > ru[:-1])  # a unit cannot fail again while in repair


def test_unit_failures_and_repair_mask_by_hand() -> None:
    unit, t = unit_failures(rng(0), np.array([0.01, 0.0, 0.02]), 1000.0)
    assert not np.any(unit == 1) and np.all(np.diff(unit) >= 0)
    for u in (0, 2):
        assert np.all(np.diff(t[unit == u]) > 0)
    # Unit 0: down [10, 60), so 30 is dropped; 70 is kept. Unit 1: 5 kept, 6 dropped.
    kept = repair_mask(np.array([0, 0, 0, 1, 1]), np.array([10.0, 30.0, 70.0, 5.0, 6.0]), np.full(5, 50.0))
    assert kept.tolist() == [True, False, True, True, False]
    assert repair_mask(np.zeros(0, int), np.zeros(0), np.zeros(0)).size == 0
