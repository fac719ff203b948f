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

Bits per value come from the wire's own encoding table (``ddiloco.core.compress``: its
``ENCODINGS`` and ``encoded_nbytes``, scales included), and data-parallel's all-reduce from
``ddiloco.protocol.traffic.dp_ring_bytes``, the baseline the runtime's traffic reports use.

``traffic_per_step`` gives the figure a run's measured traffic (metrics/traffic.json, summary.json's
``traffic``) is compared with: Decoupled DiLoCo's steady-state bytes per learner per inner step on
one learner's link, up and down, payload and modelled protocol overhead apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddiloco.core.compress import BLOCK_SIZE, CHUNK, ENCODINGS, encoded_nbytes, parse
from ddiloco.errors import ConfigError
from ddiloco.protocol.config import RuntimeConfig
from ddiloco.protocol.traffic import HEADER_BYTES, TENSOR_SPEC_BYTES, dp_ring_bytes, ratio

_WHOLE_BLOCKS = 2 * BLOCK_SIZE * CHUNK  # a length every encoding's blocks, chunks and position pairs divide


def bits_per_value(encoding: str) -> float:
    """Wire bits per value of ``encoding`` (``ddiloco.core.compress``: a value encoding, or a
    sparse ``<value>+top<k>``), scales and positions included: exact for whole chunks."""
    if parse(encoding) is None:
        raise ConfigError(
            f"encoding {encoding!r}: must be one of {', '.join(ENCODINGS)}, or one of them +top<k> "
            f"(sparse: the k largest of every {CHUNK} values, 1 <= k < {CHUNK})"
        )
    return 8.0 * encoded_nbytes(_WHOLE_BLOCKS, encoding) / _WHOLE_BLOCKS


BITS_PER_VALUE: dict[str, float] = {e: bits_per_value(e) for e in ENCODINGS}
"""Wire bits per value of each value encoding of ``ddiloco.core.compress``, scales included."""
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
        if self.dp_encoding not in BITS_PER_VALUE:  # a ring all-reduce sums dense buffers
            raise ConfigError(f"dp_encoding = {self.dp_encoding!r}: must be one of {', '.join(BITS_PER_VALUE)}")
        bits_per_value(self.encoding)


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
    ring = dp_ring_bytes(1.0, s, bytes_per_value=1.0)  # share of the buffer each site sends in a ring all-reduce
    b_dp, b = BITS_PER_VALUE[cfg.dp_encoding], bits_per_value(cfg.encoding)
    frag_interval = cfg.sync_every / cfg.fragments
    rows = [
        ("data-parallel", dp_ring_bytes(n, s, b_dp / 8) * 8, 1.0, 1.0, 1),
        ("DiLoCo", ring * n * b, float(cfg.sync_every), float(cfg.overlap), 1),
        ("Streaming DiLoCo", ring * n * b / cfg.fragments, frag_interval, float(cfg.overlap), 1),
        ("Decoupled DiLoCo", n * b / cfg.fragments, frag_interval, float(cfg.overlap), s),
    ]
    out = []
    for method, bits, interval, window, fan_in in rows:
        rate = max(bits / (interval * t), bits / (window * t)) / 1e9
        out.append(Requirement(method, bits, interval, window, rate, rate * fan_in))
    return out


@dataclass(frozen=True)
class StepTraffic:
    """Decoupled DiLoCo's steady-state traffic on one learner's link, per inner step (bytes)."""

    up_payload: float
    """Contribution payloads: every value once per H steps, in the up encoding."""
    down_payload: float
    """Merged versions' payloads: every value once per H steps, in the down encoding."""
    up_overhead: float
    """Headers of the contributions (one per fragment per H steps, a tensor spec per tensor), the
    acks (one per version) and the learner's heartbeats to each shard."""
    down_overhead: float
    """Headers of the requests (one per fragment per H steps), the versions (a tensor spec per
    tensor) and each shard's heartbeats."""
    dp_bytes: float
    """Data-parallel's bytes per learner per step for the same model and fleet: an fp32 ring
    all-reduce (``protocol.traffic.dp_ring_bytes``), sent, and as many received."""

    @property
    def up_bytes(self) -> float:
        """Bytes per inner step, learner -> syncer."""
        return self.up_payload + self.up_overhead

    @property
    def down_bytes(self) -> float:
        """Bytes per inner step, syncer -> learner."""
        return self.down_payload + self.down_overhead

    def to_json(self) -> dict[str, float | None]:
        return {
            "up_bytes_per_step": self.up_bytes,
            "down_bytes_per_step": self.down_bytes,
            "up_payload": self.up_payload,
            "down_payload": self.down_payload,
            "up_overhead": self.up_overhead,
            "down_overhead": self.down_overhead,
            "dp_bytes_per_step": self.dp_bytes,
            "dp_ratio_up": ratio(self.dp_bytes, self.up_bytes),
            "dp_ratio_down": ratio(self.dp_bytes, self.down_bytes),
        }


def traffic_per_step(
    params: int,
    fragments: int,
    sync_every: int,
    learners: int,
    encoding: str = "fp32",
    down_encoding: str | None = None,
    *,
    tensors: int = 0,
    step_s: float | None = None,
    heartbeat_interval_s: float = RuntimeConfig.heartbeat_interval_s,
    shards: int = 1,
) -> StepTraffic:
    """Predicted steady-state bytes per learner per inner step on its link, up and down: what a
    run's measured ``traffic`` (``up_bytes_per_step``, ``down_bytes_per_step``) is compared with.

    ``params`` values (N) in ``fragments`` (P), each synced every ``sync_every`` (H) steps, among
    ``learners`` (M, for the data-parallel baseline); contributions in ``encoding``, merged versions
    in ``down_encoding`` (default: the same). Every H steps a learner answers one request per
    fragment with a contribution and acknowledges one merged version per fragment. Overhead: the
    headers of those messages (``protocol.traffic.HEADER_BYTES``, ``tensors`` tensor specs per
    model copy), and, given ``step_s``, one heartbeat each way per ``heartbeat_interval_s`` per
    syncer shard. Not included: one-off traffic (joins, rejoins, the optimizer hand-off, the final
    sync), ZeroMQ's and TCP's framing, and each tensor's rounding to whole blocks (a few bytes
    per tensor for int8/int4)."""
    down_encoding = encoding if down_encoding is None else down_encoding
    for name, v in (("params", params), ("fragments", fragments), ("sync_every", sync_every), ("learners", learners),
                    ("shards", shards)):  # fmt: skip
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name} = {v!r}: must be an integer >= 1")
    for e in (encoding, down_encoding):
        bits_per_value(e)  # one line naming the encoding and the allowed ones
    if tensors < 0 or heartbeat_interval_s <= 0 or (step_s is not None and not step_s > 0):
        raise ConfigError("tensors must be >= 0, heartbeat_interval_s and step_s > 0")
    h, p = float(sync_every), float(fragments)
    beats = shards * step_s / heartbeat_interval_s if step_s is not None else 0.0  # heartbeats per step, each way
    specs = tensors * TENSOR_SPEC_BYTES  # one model copy's tensor specs, per direction per H steps
    return StepTraffic(
        up_payload=encoded_nbytes(params, encoding) / h,
        down_payload=encoded_nbytes(params, down_encoding) / h,
        up_overhead=(p * (HEADER_BYTES["contribution"] + HEADER_BYTES["ack"]) + specs) / h
        + beats * HEADER_BYTES["heartbeat"],
        down_overhead=(p * (HEADER_BYTES["request"] + HEADER_BYTES["version"]) + specs) / h
        + beats * HEADER_BYTES["syncer_heartbeat"],
        dp_bytes=dp_ring_bytes(params, learners),
    )
