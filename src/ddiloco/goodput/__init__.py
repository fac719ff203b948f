"""Datacenter-scale goodput and bandwidth simulator.

Compares data-parallel (non-elastic and elastic) training with Decoupled DiLoCo on fleets of
hundreds of thousands to millions of chips under Poisson chip failures, and sizes the
cross-site bandwidth each training method needs. See docs/goodput.md.

    >>> from ddiloco.goodput import simulate_grid, default_strategies
    >>> cells = simulate_grid([1_200_000], default_strategies([8]))
"""

from ddiloco.goodput.bands import Band, ConsistentSet, bands, consistent_set, median_member
from ddiloco.goodput.bandwidth import BandwidthConfig, Requirement, StepTraffic, required_bandwidth, traffic_per_step
from ddiloco.goodput.calibrate import (
    PAPER_DDILOCO,
    PAPER_DP,
    PAPER_ELASTIC,
    Calibration,
    calibrate,
    models_from,
)
from ddiloco.goodput.config import CALIBRATED, CostModel, FailureModel, SimConfig, Strategy
from ddiloco.goodput.simulate import (
    PAPER_CHIPS,
    Cell,
    Stat,
    default_strategies,
    lookup,
    simulate_grid,
)
from ddiloco.goodput.strategies import CATEGORIES, Outcome, run_strategy
from ddiloco.goodput.timeline import FleetTimeline, make_timeline
from ddiloco.goodput.valley import ValleyConfig, ValleyMap, load_map, map_valley

__all__ = [
    "CALIBRATED",
    "CATEGORIES",
    "PAPER_CHIPS",
    "PAPER_DDILOCO",
    "PAPER_DP",
    "PAPER_ELASTIC",
    "Band",
    "BandwidthConfig",
    "Calibration",
    "Cell",
    "ConsistentSet",
    "CostModel",
    "FailureModel",
    "FleetTimeline",
    "Outcome",
    "Requirement",
    "SimConfig",
    "Stat",
    "StepTraffic",
    "Strategy",
    "ValleyConfig",
    "ValleyMap",
    "bands",
    "calibrate",
    "consistent_set",
    "default_strategies",
    "lookup",
    "load_map",
    "make_timeline",
    "map_valley",
    "median_member",
    "models_from",
    "required_bandwidth",
    "run_strategy",
    "simulate_grid",
    "traffic_per_step",
]
