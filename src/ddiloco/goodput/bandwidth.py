"""Cross-site bandwidth needed to keep compute fully overlapped, per training method.

Each method moves ``payload`` bits across a site's wide-area link once every ``interval``
inner steps, and a transfer must be done within ``window`` steps so that no learner ever waits.
The link therefore needs ``max(payload / (interval * t), payload / (window * t))`` bits/s: the
first term is the sustained rate, the second the peak that the overlap window allows.

- Data-parallel: a ring all-reduce of the gradients among the sites every step; it overlaps
  with at most one step of compute. Each site sends ``2 (S - 1) / S`` gradients per step.
- DiLoCo: the same all-reduce of the whole outer gradient every H steps, hidden behind tau
  steps (plain DiLoCo blocks instead; tau is the overlap an eager/one-step-delayed variant gets).
- Streaming DiLoCo: the all-reduce of one of P fragments every H / P steps, within tau steps.
- Decoupled DiLoCo: no all-reduce; each learner sends one fragment to the syncer and receives
  the merged one every H / P steps, within tau steps. The figure is per learner link and per
  direction; the syncer's site aggregates S such links.

Bits per value mirror ``ddiloco.core.compress`` (int8/int4 carry one float32 scale per block
of 128 values), without importing torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddiloco.errors import ConfigError

BITS_PER_VALUE: dict[str, float] = {"fp32": 32.0, "bf16": 16.0, "int8": 8.0 + 32.0 / 128, "int4": 4.0 + 32.0 / 128}
"""Wire bits per value of each encoding, scales included (see ddiloco.core.compress)."""
METHODS = ("data-parallel", "DiLoCo", "Streaming DiLoCo", "Decoupled DiLoCo")


@dataclass(frozen=True)
class BandwidthConfig:
    """A training setup whose cross-site traffic we size."""

    params: float = 5e9
    """Model parameters."""
    step_s: float = 0.707
    """Inner step time (forward + backward + inner optimizer), seconds."""
    sites: int = 8
    """Sites (data centres); one learner per site for the DiLoCo family."""
    fragments: int = 24
    """P: fragments of the model (Streaming / Decoupled DiLoCo)."""
    sync_every: int = 24
    """H: inner steps between two syncs of the same fragment (of the whole model for DiLoCo)."""
    overlap: int = 2
    """tau: steps a transfer may take while compute goes on."""
    encoding: str = "int4"
    """Encoding of outer gradients / fragments for the DiLoCo family."""
    dp_encoding: str = "bf16"
    """Encoding of data-parallel gradients."""

    def __post_init__(self) -> None:
        for name in ("params", "step_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} = {v!r}: must be a finite number > 0")
        for name in ("sites", "fragments", "sync_every", "overlap"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} = {v!r}: must be an integer >= 1")
        if self.sites < 2:
            raise ConfigError(f"sites = {self.sites}: must be >= 2 for cross-site traffic")
        if self.fragments > self.sync_every:
            raise ConfigError(
                f"fragments (P) = {self.fragments}: must be <= sync_every (H) = "
                f"{self.sync_every}, at most one fragment is due per step"
            )
        for name in ("encoding", "dp_encoding"):
            v = getattr(self, name)
            if v not in BITS_PER_VALUE:
                raise ConfigError(f"{name} = {v!r}: must be one of {', '.join(BITS_PER_VALUE)}")


@dataclass(frozen=True)
class Requirement:
    """The link one method needs."""

    method: str
    """One of ``METHODS``."""
    payload_bits: float
    """Bits one site sends per sync."""
    interval_steps: float
    """Inner steps between two syncs."""
    window_steps: float
    """Steps a sync may take and still be hidden behind compute."""
    gbps: float
    """Needed bandwidth per site link, per direction, Gbit/s."""
    hub_gbps: float
    """Decoupled DiLoCo: the syncer site's aggregate (all learners); else equal to ``gbps``."""

    def to_json(self) -> dict:
        return {
            "method": self.method,
            "payload_bits": self.payload_bits,
            "interval_steps": self.interval_steps,
            "window_steps": self.window_steps,
            "gbps": self.gbps,
            "hub_gbps": self.hub_gbps,
        }


def required_bandwidth(cfg: BandwidthConfig) -> list[Requirement]:
    """Bandwidth each method in ``METHODS`` needs to keep compute fully overlapped."""
    n, s, t = cfg.params, cfg.sites, cfg.step_s
    ring = 2.0 * (s - 1) / s  # share of the buffer each site sends in a ring all-reduce
    b_dp, b = BITS_PER_VALUE[cfg.dp_encoding], BITS_PER_VALUE[cfg.encoding]
    frag_interval = cfg.sync_every / cfg.fragments
    rows = [
        ("data-parallel", ring * n * b_dp, 1.0, 1.0, 1),
        ("DiLoCo", ring * n * b, float(cfg.sync_every), float(cfg.overlap), 1),
        ("Streaming DiLoCo", ring * n * b / cfg.fragments, frag_interval, float(cfg.overlap), 1),
        ("Decoupled DiLoCo", n * b / cfg.fragments, frag_interval, float(cfg.overlap), s),
    ]
    out = []
    for method, bits, interval, window, fan_in in rows:
        rate = max(bits / (interval * t), bits / (window * t)) / 1e9
        out.append(Requirement(method, bits, interval, window, rate, rate * fan_in))
    return out
