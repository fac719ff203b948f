"""A target run (billions of parameters, its link, step time and failures) and the small local run
that stands for it, with the goodput the target's learner losses predict.

Scale equivalence: a local run stands for the target when the two ratios that decide Decoupled
DiLoCo's behaviour are the same,

    transfer time / step time:  (N_l / R_l) / t_l = (N_t / R_t) / t_t
    time between faults / step time:  F_l / t_l = F_t / t_t

(N: the model's fp32 bytes, R: a learner's link rate, t: the inner step, F: the time between
learner losses). With k = t_t / t_l target seconds per local second, R_l = R_t (N_l / N_t) k and
F_l = F_t / k; every local time times k is a target time. What does not scale (docs/runtime.md,
"Scale-equivalent runs"): a process's start-up (imports, building the model, reading its save),
the syncer's CPU time per merge, and memory.

The prediction is time accounting, the launcher's: each learner loss costs that learner its
restart delay, its start-up and the bytes it must fetch before its first step over its link;
goodput from the first step is the learner-time left over, against the learner-time allocated.

This module is pure: arithmetic only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ddiloco.errors import ConfigError

LossKind = Literal["restart", "replace"]


@dataclass(frozen=True)
class Target:
    """The run a local run stands for."""

    params: float = 7e9
    """Model parameters."""
    step_s: float = 4.0
    """Inner step time, seconds."""
    learners: int = 4
    """Learners M."""
    loss_every_s: float = 1800.0
    """One learner lost per this many seconds, fleet-wide (not per learner)."""
    link_bps: float = 1e9
    """Each learner's link, bits per second each way."""

    def __post_init__(self) -> None:
        for name in ("params", "step_s", "loss_every_s", "link_bps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ConfigError(f"target {name} = {value!r}: must be a positive number")
        if not isinstance(self.learners, int) or self.learners < 1:
            raise ConfigError(f"target learners = {self.learners!r}: must be an integer >= 1")

    @property
    def model_bytes(self) -> float:
        """N_t: the model's fp32 bytes."""
        return 4.0 * self.params

    def transfer_steps(self) -> float:
        """Inner steps one whole fp32 model takes over one learner's link."""
        return self.model_bytes * 8 / self.link_bps / self.step_s


@dataclass(frozen=True)
class Equivalence:
    """The local run's link and fault times that keep the target's ratios."""

    target: Target
    """What it stands for."""
    local_params: float
    """The local model's parameters."""
    local_step_s: float
    """The local inner step, seconds."""

    @property
    def k(self) -> float:
        """Target seconds per local second."""
        return self.target.step_s / self.local_step_s

    @property
    def local_model_bytes(self) -> float:
        return 4.0 * self.local_params

    @property
    def link_bps(self) -> float:
        """R_l: the local link rate with the target's transfer time over step time."""
        return self.target.link_bps * (self.local_model_bytes / self.target.model_bytes) * self.k

    @property
    def loss_every_s(self) -> float:
        """F_l: local seconds between learner losses."""
        return self.target.loss_every_s / self.k

    def to_target_s(self, local_s: float) -> float:
        return local_s * self.k

    def to_local_s(self, target_s: float) -> float:
        return target_s / self.k


def equivalent(target: Target, local_params: float, local_step_s: float) -> Equivalence:
    """The local run (``local_params`` parameters, ``local_step_s`` a step) that stands for ``target``."""
    if not (local_params > 0 and local_step_s > 0):
        raise ConfigError("the local model's parameters and step time must be positive")
    return Equivalence(target, float(local_params), float(local_step_s))


@dataclass(frozen=True)
class LossCosts:
    """What one learner loss costs, in the target's seconds and its model's bytes."""

    restart_delay_s: float = 30.0
    """From the loss until its process starts again (a new machine, a requeue)."""
    startup_s: float = 60.0
    """From its process's start until it can fetch: imports, building the model, reading its save."""
    restart_moves_n: float = 0.13
    """What a learner restarted with its saved state fetches before its first step, over N
    (the chain of changes since its save; docs/results/events.md measured 0.13 N)."""
    replace_moves_n: float = 1.0
    """What a replacement without state fetches before its first step, over N (the global
    fragments in fp32; the peer's optimizer state follows while it already trains)."""

    def __post_init__(self) -> None:
        for name in ("restart_delay_s", "startup_s", "restart_moves_n", "replace_moves_n"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
                raise ConfigError(f"{name} = {value!r}: must be a number >= 0")

    def of(self, kind: LossKind, target: Target) -> float:
        """One loss's cost in learner-seconds of the target."""
        moved = self.restart_moves_n if kind == "restart" else self.replace_moves_n
        return self.restart_delay_s + self.startup_s + moved * target.model_bytes * 8 / target.link_bps


@dataclass(frozen=True)
class Prediction:
    """Predicted shares of allocated learner-time (the launcher's accounting)."""

    goodput: float
    """From every learner's first step: learner-time on inner steps / learner-time allocated."""
    goodput_with_first_join: float
    """The same with the first join counted (each learner's start-up and first download)."""
    lost_learner_s: float
    """Learner-seconds the losses cost."""
    first_join_s: float
    """One learner's first start-up and download, seconds."""


def scheduled_losses(target: Target, horizon_s: float) -> list[tuple[float, LossKind]]:
    """Losses at F (i + 1/2) inside the horizon, restarts and replacements in turn (the first a
    restart): a fixed schedule at the target's rate, so a short run has the mean rate."""
    out: list[tuple[float, LossKind]] = []
    t = target.loss_every_s / 2
    while t < horizon_s:
        out.append((t, "restart" if len(out) % 2 == 0 else "replace"))
        t += target.loss_every_s
    return out


def predict(
    target: Target, costs: LossCosts, horizon_s: float, losses: Sequence[tuple[float, LossKind]] | None = None
) -> Prediction:
    """Goodput of ``target`` over ``horizon_s`` seconds from the first step with ``losses`` (time
    from the first step, kind; default: ``scheduled_losses``). A loss near the end costs only
    what is left of the horizon."""
    if not horizon_s > 0:
        raise ConfigError(f"horizon = {horizon_s!r} s: must be positive")
    chosen = scheduled_losses(target, horizon_s) if losses is None else list(losses)
    lost = sum(min(costs.of(kind, target), max(horizon_s - t, 0.0)) for t, kind in chosen)
    alloc = target.learners * horizon_s
    first_join = costs.startup_s + target.model_bytes * 8 / target.link_bps
    return Prediction(
        goodput=1.0 - lost / alloc,
        goodput_with_first_join=1.0 - (lost + target.learners * first_join) / (alloc + target.learners * first_join),
        lost_learner_s=lost,
        first_join_s=first_join,
    )


def long_run_goodput(target: Target, costs: LossCosts, replace_share: float = 0.5) -> float:
    """Goodput over a long run (the first join negligible): 1 - mean loss cost / (M F)."""
    if not 0.0 <= replace_share <= 1.0:
        raise ConfigError(f"replace share = {replace_share!r}: must be in [0, 1]")
    mean = (1 - replace_share) * costs.of("restart", target) + replace_share * costs.of("replace", target)
    return max(0.0, 1.0 - mean / (target.learners * target.loss_every_s))
