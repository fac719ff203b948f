"""Run one configured method in virtual time (the entry point the CLI and benchmarks share)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ddiloco.config import Config
from ddiloco.report.result import Progress, RunResult
from ddiloco.workloads.base import Workload
from ddiloco.workloads.config import load_workload


def simulate(
    cfg: Config,
    workload: Workload | None = None,
    on_progress: Progress | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> RunResult:
    """Train ``cfg.run.method`` in virtual time and return its result. ``should_stop`` is polled
    as the run goes: once it says True the run ends early, with a result marked partial."""
    torch.set_num_threads(cfg.run.threads)
    wl = workload if workload is not None else load_workload(cfg.workload)
    if cfg.run.method == "dp":
        from ddiloco.sim.dp import run_data_parallel

        return run_data_parallel(cfg, wl, on_progress, should_stop)
    from ddiloco.sim.simulation import Simulation

    return Simulation(cfg, wl, on_progress, should_stop).run()
