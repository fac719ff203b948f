"""Chaos schedules for the training runtimes: when each learner fails, for how long, and who
straggles. The same config drives the virtual-time simulator (and later the real runtime)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ddiloco.errors import ConfigError, require
from ddiloco.link.config import LinkFaults, parse_fault, parse_link, parse_site_rate, split_learner


@dataclass(frozen=True)
class ChaosConfig:
    """Failures and stragglers injected into a run."""

    enabled: bool = False
    """Whether to inject anything at all."""
    downtime_fraction: float = 0.10
    """Share of the run each learner is unavailable (down plus restarting)."""
    failures_per_learner: int = 2
    """Failures of each learner over the run; the seed places them, the totals are fixed."""
    restart_s: float = 2.0
    """Part of each outage spent restarting (process start, fetching the global state)."""
    stragglers: tuple[str, ...] = ()
    """Slow learners as 'LEARNER:FACTOR' (whole run) or 'LEARNER:FACTOR:START:END' with START
    and END as fractions of the run; a factor of 2 makes each step take twice as long."""
    learners: tuple[int, ...] = ()
    """Learners that fail (empty: all of them)."""
    kill_mtbf_s: float = 0.0
    """Real runtime: SIGKILL each learner at Poisson times with this mean time between kills
    (0 = use the fixed-downtime schedule above instead); a killed learner restarts at once."""
    syncer_kills: tuple[float, ...] = ()
    """Real runtime: SIGKILL the syncer at these fractions of the run (restarted after
    ``syncer_down_s`` on the same run dir)."""
    syncer_down_s: float = 2.0
    """Real runtime: how long a killed syncer stays down."""
    links: tuple[str, ...] = ()
    """Real runtime: learners behind an emulated link (a relay between them and the syncer), as
    'LEARNER:LINK', e.g. '1:10mbit,50ms' or '0:2mbit,100ms,jitter=10ms,stall=0.01:200ms'
    (the syntax: docs/runtime.md#link-emulator)."""
    site_link: str = ""
    """Real runtime: an aggregate cap per direction that every relayed learner shares (a site's
    link), e.g. '100mbit'; set, every learner goes through a relay. Empty: none."""
    link_faults: tuple[str, ...] = ()
    """Real runtime: partitions and resets of a learner's link, as 'LEARNER:FAULT' with FAULT one
    of hold:DURATION@TIME, cut:DURATION@TIME (TIME in seconds or % of runtime.duration_s),
    reset_every:PERIOD, reset_mean:MEAN, flap:UP/DOWN; e.g. '1:hold:30s@40%', '0:cut:30s@50%',
    '1:reset_mean:10s', '1:flap:10s/5s'."""
    hosts: bool = False
    """Real runtime (Linux, as root; ``ddiloco train`` only): every process on an emulated host of
    its own, a network namespace joined to the others by a veth pair (ddiloco.link.hosts): the
    syncer, each learner, the evaluator. A learner's link rate (``links``) then comes from the
    kernel (tbf) and its delay, stalls and faults from the relay in the syncer's host; keys are
    required. Set up at start, torn down at the end (what a crashed launcher left goes at the
    next start)."""

    def validate(self, num_learners: int) -> None:
        require(0.0 <= self.downtime_fraction < 1.0, "chaos.downtime_fraction", self.downtime_fraction, "[0, 1)")
        require(self.failures_per_learner >= 0, "chaos.failures_per_learner", self.failures_per_learner, ">= 0")
        require(self.restart_s >= 0, "chaos.restart_s", self.restart_s, ">= 0")
        for s in self.stragglers:
            parse_straggler(s, num_learners)
        if self.kill_mtbf_s < 0 or self.syncer_down_s < 0:
            raise ConfigError("chaos.kill_mtbf_s and chaos.syncer_down_s must be >= 0")
        if any(not 0.0 < f < 1.0 for f in self.syncer_kills):
            raise ConfigError(
                f"chaos.syncer_kills = {list(self.syncer_kills)}: each must be a fraction of the run in (0, 1)"
            )
        for m in self.learners:
            if not 0 <= m < num_learners:
                raise ConfigError(f"chaos.learners contains {m}; allowed: 0 .. {num_learners - 1}")
        link_plan(self, num_learners)  # each bad entry: one line


def link_plan(
    cfg: ChaosConfig, num_learners: int, horizon_s: float | None = None
) -> dict[int, tuple[str, tuple[str, ...]]]:
    """Learner -> (its link string, its fault strings) for every learner behind a relay (all of
    them when there is a site link), validated; ``horizon_s``: the run's length, what a '%' is a
    fraction of (None: unknown yet, so overlapping partitions are not looked for)."""
    links: dict[int, str] = {}
    for text in cfg.links:
        m, spec = split_learner(text, num_learners, "chaos.links")
        if m in links:
            raise ConfigError(f"chaos.links has two entries for learner {m}; give each learner one link string")
        parse_link(spec)
        links[m] = spec
    faults: dict[int, list[str]] = {}
    for text in cfg.link_faults:
        m, spec = split_learner(text, num_learners, "chaos.link_faults")
        parse_fault(spec, 1.0 if horizon_s is None else horizon_s)
        faults.setdefault(m, []).append(spec)
    for m, specs in faults.items() if horizon_s is not None else ():  # partitions of one link must not overlap
        parts = LinkFaults.parse(specs, horizon_s).partitions
        for a, b in zip(parts, parts[1:]):
            if b.start_s < a.end_s:
                raise ConfigError(f"chaos.link_faults: learner {m}'s {a.kind} and {b.kind} overlap; give them apart")
    if cfg.site_link:
        parse_site_rate(cfg.site_link)
    relayed = range(num_learners) if cfg.site_link else sorted({*links, *faults})
    return {m: (links.get(m, ""), tuple(faults.get(m, ()))) for m in relayed}


@dataclass(frozen=True)
class Straggler:
    """Learner ``learner`` runs ``factor`` times slower during [start_s, end_s)."""

    learner: int
    factor: float
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Outage:
    """Learner ``learner`` is down from ``start_s`` and back (restarted) at ``end_s``."""

    learner: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class ChaosSchedule:
    """Concrete outages and straggler windows for one run."""

    outages: tuple[Outage, ...] = ()
    stragglers: tuple[Straggler, ...] = ()
    restart_s: float = 0.0

    def straggler_events(self, end: float) -> list[dict[str, Any]]:
        """The straggler phases that began before ``end`` (the run's end), as the simulator's log
        events: ``straggle`` with its factor, and ``straggle_end`` when it ended before the run did."""
        out: list[dict[str, Any]] = []
        for s in self.stragglers:
            if s.start_s < end:
                out.append({"event": "straggle", "time": s.start_s, "learner": s.learner, "factor": s.factor})
                if s.end_s < end:
                    out.append({"event": "straggle_end", "time": s.end_s, "learner": s.learner})
        return sorted(out, key=lambda e: e["time"])

    def slowdown(self, learner: int, t: float) -> float:
        f = 1.0
        for s in self.stragglers:
            if s.learner == learner and s.start_s <= t < s.end_s:
                f *= s.factor
        return f


def parse_straggler(text: str, num_learners: int, horizon_s: float = 1.0) -> Straggler:
    """'LEARNER:FACTOR[:START:END]' (START/END as fractions of the run) -> Straggler."""
    parts = text.split(":")
    try:
        if len(parts) not in (2, 4):
            raise ValueError
        m, factor = int(parts[0]), float(parts[1])
        start, end = (float(parts[2]), float(parts[3])) if len(parts) == 4 else (0.0, 1.0)
    except ValueError:
        raise ConfigError(
            f"chaos.stragglers entry {text!r} is malformed; use 'LEARNER:FACTOR' or 'LEARNER:FACTOR:START:END'"
        ) from None
    if not 0 <= m < num_learners or factor < 1.0 or not 0 <= start < end <= 1.0:
        raise ConfigError(
            f"chaos.stragglers entry {text!r} is out of range; learner in 0..{num_learners - 1}, factor >= 1, 0 <= "
            "START < END <= 1"
        )
    return Straggler(m, factor, start * horizon_s, end * horizon_s)


def make_schedule(cfg: ChaosConfig, num_learners: int, horizon_s: float, seed: int) -> ChaosSchedule:
    """Place each learner's fixed number of failures, with fixed total downtime, at random.

    The up-time is cut at sorted uniform points and the outages (a random split of the
    downtime, each at least restart_s long) are inserted there, so outages never overlap and
    the realised downtime equals ``downtime_fraction * horizon_s`` exactly.
    """
    if not cfg.enabled:
        return ChaosSchedule()
    rng = np.random.default_rng([seed, 0xC4A05])
    if cfg.kill_mtbf_s > 0:
        return _poisson_kills(cfg, num_learners, horizon_s, rng)
    outages: list[Outage] = []
    failing = cfg.learners or tuple(range(num_learners))
    n = cfg.failures_per_learner
    total_down = cfg.downtime_fraction * horizon_s
    for m in range(num_learners):
        # Draw for every learner so adding one to `learners` does not move the others.
        cuts = np.sort(rng.uniform(0.0, horizon_s - total_down, size=n))
        split = rng.dirichlet(np.full(n, 4.0)) if n else np.zeros(0)
        if m not in failing or n == 0 or total_down == 0:
            continue
        durations = np.maximum(split * total_down, cfg.restart_s)
        durations *= total_down / durations.sum()
        shift = 0.0
        for cut, d in zip(cuts, durations):
            start = float(cut + shift)
            outages.append(Outage(m, start, start + float(d)))
            shift += float(d)
    stragglers = tuple(parse_straggler(s, num_learners, horizon_s) for s in cfg.stragglers)
    return ChaosSchedule(tuple(sorted(outages, key=lambda o: (o.start_s, o.learner))), stragglers, cfg.restart_s)


def _poisson_kills(cfg: ChaosConfig, num_learners: int, horizon_s: float, rng: np.random.Generator) -> ChaosSchedule:
    """Kills at Poisson times (mean ``kill_mtbf_s`` per learner), each restarted at once."""
    from ddiloco.chaos.distributions import poisson_failure_times

    failing = cfg.learners or tuple(range(num_learners))
    outages = []
    for m in range(num_learners):
        times = poisson_failure_times(rng, 1.0 / cfg.kill_mtbf_s, horizon_s)
        if m in failing:
            outages += [Outage(m, float(t), float(t)) for t in times]
    stragglers = tuple(parse_straggler(s, num_learners, horizon_s) for s in cfg.stragglers)
    return ChaosSchedule(tuple(sorted(outages, key=lambda o: (o.start_s, o.learner))), stragglers, 0.0)
