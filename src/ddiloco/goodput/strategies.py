"""Play one strategy over one fleet timeline and account for every chip-second.

Each strategy splits the fleet's slices into groups (one group for data-parallel, M learners for
Decoupled DiLoCo). Within a group, every event that changes the group's healthy set starts a
recovery: a full restart (non-elastic) or a reconfiguration pause (elastic). A recovery cut
short by the group's next event starts again with that event's own duration. Between the end
of a recovery and the group's next event the group runs on its healthy chips; if that run is
ended by a failure, the work since the last checkpoint (non-elastic) or the step in flight
(elastic) is lost. Groups never wait for each other, except that the system only advances
while at least K of them run: below that the running groups' time counts as blocked.

All of this is vectorised: per event, then one sorted sweep over run starts and ends for the
quorum. Allocated chip-time splits exactly into the categories of ``Outcome.chip_time``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddiloco.goodput.config import CostModel, Strategy
from ddiloco.goodput.timeline import FleetTimeline

CATEGORIES = ("useful", "slow", "lost_work", "recovery", "repair", "blocked")
"""Where allocated chip-time goes: useful training; waiting on the slowest chip; work lost to a
failure (since the checkpoint or in the step in flight); restarts and reconfiguration pauses;
chips in repair (elastic groups run without them); running but below quorum."""


@dataclass(frozen=True)
class Outcome:
    """What one strategy achieved on one timeline, over the measured window."""

    goodput: float
    """Useful chip-time / allocated chip-time."""
    uptime: float
    """Share of the window in which the system as a whole advanced (>= K groups running)."""
    chip_time: dict[str, float]
    """Allocated chip-seconds by category (``CATEGORIES``); they sum to ``allocated``."""
    allocated: float
    """Chips times the measured window, chip-seconds."""
    failures: int
    """Slice failures this strategy saw in the measured window (a non-elastic job also sees
    those of its hot spares)."""


def group_of_slices(n_slices: int, groups: int) -> np.ndarray:
    """Contiguous, near-equal split of slices into groups: the group of each slice."""
    counts = np.full(groups, n_slices // groups)
    counts[: n_slices % groups] += 1
    return np.repeat(np.arange(groups), counts)


def run_strategy(tl: FleetTimeline, strategy: Strategy, costs: CostModel) -> Outcome:
    """Simulate ``strategy`` on ``tl`` and return its goodput, uptime and chip-time split."""
    m = strategy.learners
    group = group_of_slices(tl.slice_chips.size, m)
    group_chips = np.bincount(group, weights=tl.slice_chips, minlength=m)
    group_speed = np.minimum.reduceat(tl.slice_speed, np.searchsorted(group, np.arange(m)))

    if strategy.elastic:
        sel = ~tl.hits_spare
        pause = tl.reconfig_s
        # Failed chips leave an elastic group until they return.
        delta = np.where(tl.is_failure, 1.0, -1.0) * tl.slice_chips[tl.slice_id]
        quantum = costs.step_s
    else:
        # Non-elastic: only failures matter, including those of hot spares standing in for
        # slices in repair; spares replace failed slices at restart, so returns change nothing
        # and the job always runs at full size.
        sel = tl.is_failure
        pause = tl.restart_s
        delta = np.zeros(tl.t.size)
        quantum = costs.checkpoint_s

    # Prepend a virtual "start" event per group at t = 0 so every run interval has an event
    # that opens it; a stable sort by group keeps each group's events in time order.
    t = np.concatenate([np.zeros(m), tl.t[sel]])
    g = np.concatenate([np.arange(m), group[tl.slice_id[sel]]])
    p = np.concatenate([np.zeros(m), pause[sel]])
    d = np.concatenate([np.zeros(m), delta[sel]])
    f = np.concatenate([np.zeros(m, bool), tl.is_failure[sel]])
    order = np.argsort(g, kind="stable")
    t, g, p, d, f = t[order], g[order], p[order], d[order], f[order]

    first = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])  # one per group: its virtual start
    cs = np.cumsum(d)
    up = group_chips[g] - (cs - (cs - d)[first][g])  # healthy chips after each event
    last = np.r_[g[1:] != g[:-1], True]
    nxt = np.where(last, tl.horizon_s, np.r_[t[1:], 0.0])
    ends_in_failure = ~last & np.r_[f[1:], False]

    rec_end = np.minimum(t + p, nxt)  # recovery, cut short by next event
    run_len = np.maximum(nxt - (t + p), 0.0)
    kept = np.where(ends_in_failure, np.floor(run_len / quantum) * quantum, run_len)
    running = (run_len > 0) & (up > 0)

    w0, w1 = tl.warmup_s, tl.horizon_s
    span = w1 - w0

    def overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.clip(np.minimum(b, w1) - np.maximum(a, w0), 0.0, None)

    repair = float(np.sum((group_chips[g] - up) * overlap(t, nxt)))
    recovery = float(np.sum(up * overlap(t, rec_end)))

    # Quorum sweep: count of running groups and the rates of useful / slow / lost chip-time.
    rs, ks, ne = (t + p)[running], (t + p + kept)[running], nxt[running]
    u, v = up[running], group_speed[g[running]]
    pts = np.concatenate([rs, ks, ne])
    z = np.zeros_like(u)
    dcount = np.concatenate([np.ones_like(u), z, -np.ones_like(u)])
    duse = np.concatenate([u * v, -u * v, z])
    dslow = np.concatenate([u * (1 - v), -u * (1 - v), z])
    dlost = np.concatenate([z, u, -u])
    o = np.argsort(pts, kind="stable")
    pts = pts[o]
    count = np.cumsum(dcount[o])
    use, slow, lost = np.cumsum(duse[o]), np.cumsum(dslow[o]), np.cumsum(dlost[o])
    seg = overlap(pts, np.r_[pts[1:], w1])
    ok = count >= strategy.quorum
    chip_time = {
        "useful": float(np.sum(use * seg * ok)),
        "slow": float(np.sum(slow * seg * ok)),
        "lost_work": float(np.sum(lost * seg * ok)),
        "recovery": recovery,
        "repair": repair,
        "blocked": float(np.sum((use + slow + lost) * seg * ~ok)),
    }
    allocated = float(group_chips.sum()) * span
    return Outcome(
        goodput=chip_time["useful"] / allocated,
        uptime=float(np.sum(seg * ok)) / span,
        chip_time=chip_time,
        allocated=allocated,
        failures=int(np.count_nonzero(f & (t >= w0))),
    )
