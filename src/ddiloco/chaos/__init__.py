"""Failure models shared by the training runtimes and the goodput simulator.

The vocabulary is deliberately small: duration distributions (``Fixed``, ``Exponential``,
``Weibull``) with ``.mean`` and ``.sample(rng, size)``, a config-string parser, and Poisson
failure sampling. Every sampler takes an explicit ``numpy.random.Generator``.
"""

from ddiloco.chaos.distributions import (
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

__all__ = [
    "SECONDS_PER_YEAR",
    "Distribution",
    "Exponential",
    "Fixed",
    "Weibull",
    "failure_repair_cycles",
    "format_duration",
    "parse_distribution",
    "parse_duration",
    "poisson_failure_times",
    "repair_mask",
    "unit_failures",
]
