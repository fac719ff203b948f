"""What a link looks like (``LinkConfig``) and what happens to it (``LinkFaults``), with the
compact strings the command line and the chaos section use.

Link strings are comma-separated items; a bare rate or delay needs no key::

    10mbit,50ms                          both directions: 10 Mbit/s, 50 ms one way
    2mbit,100ms,jitter=10ms,stall=0.01:200ms
    10mbit,20ms,up.rate=1mbit            learner -> syncer at 1 Mbit/s, the other way at 10
    buffer=256KiB,chunk=16KiB            the relay's own queue per direction, its read size

Keys: ``rate``, ``latency`` (or ``delay``), ``jitter``, ``stall=P:DURATION`` (each CHUNK bytes
forwarded is held DURATION with probability P, as a lost segment holds a TCP stream until it
is sent again), each for both directions or prefixed ``up.`` (learner to syncer, the connecting
side to the listened-to side) or ``down.``; ``buffer`` and ``chunk`` for the relay. Rates are
NUMBER + bit/kbit/mbit/gbit (powers of 1000; ``inf`` for none), delays NUMBER + us/ms/s/min/h,
sizes NUMBER + B/KB/KiB/MB/MiB, probabilities a number in [0, 1] or a percentage.

Fault strings, one fault each (``LinkFaults.parse`` takes several)::

    hold:30s@40%        nothing forwarded for 30 s from 40 % of the run (or @120s), then all of it
    cut:30s@120s        every connection reset at 120 s, new ones closed at once for 30 s
    reset_every:10s     every connection reset every 10 s
    reset_mean:10s      every connection reset at Poisson times, 10 s apart on average
    flap:10s/5s         up 10 s, cut 5 s, over and over

A time with ``%`` is a fraction of the run's length and needs one (``horizon_s``).

This module is pure: parsing and validation only, no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Literal

from ddiloco.errors import ConfigError, require

RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}
SIZE_UNITS: dict[str, float] = {"b": 1, "kb": 1000, "kib": 1024, "mb": 1000**2, "mib": 1024**2}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?"
_QUANTITY = re.compile(rf"^({_NUMBER})\s*([a-z]+)$", re.IGNORECASE)
DIRECTION_KEYS = ("rate", "latency", "delay", "jitter", "stall")
LINK_KEYS = ("buffer", "chunk")
LINK_SYNTAX = (
    "comma-separated items: RATE (e.g. 10mbit), LATENCY (e.g. 50ms), rate=, latency=, jitter=, stall=P:DURATION, "
    "each also as up.KEY= or down.KEY=, and buffer=SIZE, chunk=SIZE"
)


def _quantity(text: str, units: dict[str, float], what: str, where: str) -> float:
    m = _QUANTITY.match(text.strip())
    if m is None or m.group(3).lower() not in units:
        raise ConfigError(f"{where}: {text!r} is not {what} (a number and one of {', '.join(units)})")
    return float(m.group(1)) * units[m.group(3).lower()]


def parse_rate(text: str, where: str = "link") -> float:
    """'10mbit' -> 1e7 bits/s; 'inf' (or 0) -> 0.0, meaning no cap."""
    if text.strip().lower() in ("inf", "0"):
        return 0.0
    rate = _quantity(text, RATE_UNITS, "a rate", where)
    require(rate > 0, f"{where} rate", text, "> 0 (or inf for no cap)")
    return rate


def parse_delay(text: str, where: str = "link") -> float:
    """'50ms' -> 0.05 s ('0' alone is 0)."""
    return 0.0 if text.strip() == "0" else _quantity(text, DELAY_UNITS, "a duration", where)


def parse_size(text: str, where: str = "link") -> int:
    """'256KiB' -> 262144 bytes."""
    return int(_quantity(text, SIZE_UNITS, "a size", where))


def parse_probability(text: str, where: str = "link") -> float:
    """'0.01' or '1%' -> 0.01."""
    t = text.strip()
    try:
        p = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise ConfigError(f"{where}: {text!r} is not a probability (a number in [0, 1] or a percentage)") from None
    require(0.0 <= p <= 1.0, f"{where} probability", text, "0 .. 1 (or 0% .. 100%)")
    return p


@dataclass(frozen=True)
class DirectionConfig:
    """One direction of a link: what a chunk of bytes meets on its way."""

    rate_bps: float = 0.0
    """Bandwidth cap in bits per second (0: none)."""
    latency_s: float = 0.0
    """One-way delay added to every chunk."""
    jitter_s: float = 0.0
    """Each chunk's delay is latency_s + uniform(-jitter_s, +jitter_s); at most latency_s. The
    stream stays in order: a chunk never leaves before the one ahead of it."""
    stall_prob: float = 0.0
    """Probability, per ``chunk_bytes`` forwarded, that a chunk is held ``stall_s`` longer (the
    stall a lost segment causes on TCP; everything behind it waits too)."""
    stall_s: float = 0.0
    """How long a stalled chunk is held."""

    def validate(self, where: str) -> None:
        require(self.rate_bps >= 0, f"{where}.rate_bps", self.rate_bps, ">= 0 (0: no cap)")
        require(self.latency_s >= 0, f"{where}.latency_s", self.latency_s, ">= 0")
        require(0 <= self.jitter_s <= self.latency_s, f"{where}.jitter_s", self.jitter_s, "0 .. latency_s")
        require(0 <= self.stall_prob <= 1, f"{where}.stall_prob", self.stall_prob, "0 .. 1")
        require(self.stall_s >= 0, f"{where}.stall_s", self.stall_s, ">= 0")

    def describe(self) -> str:
        parts = [f"{self.rate_bps / 1e6:g} Mbit/s" if self.rate_bps else "no rate cap"]
        if self.latency_s:
            parts.append(f"{self.latency_s * 1e3:g} ms" + (f" ± {self.jitter_s * 1e3:g}" if self.jitter_s else ""))
        if self.stall_prob and self.stall_s:
            parts.append(f"stalls {self.stall_prob:g} x {self.stall_s * 1e3:g} ms")
        return ", ".join(parts)


@dataclass(frozen=True)
class LinkConfig:
    """A link between a learner and its syncer, as the relay emulates it."""

    up: DirectionConfig = field(default_factory=DirectionConfig)
    """Learner to syncer (the connecting side to the side the relay forwards to)."""
    down: DirectionConfig = field(default_factory=DirectionConfig)
    """Syncer to learner."""
    buffer_bytes: int = 4 * 1024**2
    """The relay's queue per direction and connection: full, it stops reading from the sender
    (backpressure). It also bounds the bytes in flight, as a TCP window does: keep it above
    rate x latency, or the link runs slower than its rate."""
    chunk_bytes: int = 64 * 1024
    """The most bytes read (and scheduled) at once; the unit ``stall_prob`` counts in."""

    def validate(self) -> LinkConfig:
        self.up.validate("link.up")
        self.down.validate("link.down")
        require(self.chunk_bytes >= 1, "link.chunk_bytes", self.chunk_bytes, ">= 1")
        require(self.buffer_bytes >= self.chunk_bytes, "link.buffer_bytes", self.buffer_bytes, ">= chunk_bytes")
        return self

    @classmethod
    def parse(cls, text: str) -> LinkConfig:
        """A link string (see the module's docs) -> a validated LinkConfig; '' is no shaping."""
        return parse_link(text)

    def describe(self) -> str:
        up, down = self.up.describe(), self.down.describe()
        return up if up == down else f"up {up}; down {down}"


def parse_link(text: str) -> LinkConfig:
    """A link string -> a validated LinkConfig; every bad item raises ConfigError in one line."""
    where = f"link {text!r}"
    values: dict[str, dict[str, float]] = {"up": {}, "down": {}}
    link: dict[str, int] = {}
    for raw in (t.strip() for t in text.split(",")):
        if not raw:
            continue
        key, value = _item(raw, where)
        if key in LINK_KEYS:
            link[key] = parse_size(value, where)
            continue
        directions, _, name = key.rpartition(".")
        if name not in DIRECTION_KEYS or directions not in ("", "up", "down"):
            raise ConfigError(f"{where}: unknown key {key!r}; use {LINK_SYNTAX}")
        for d in (directions,) if directions else ("up", "down"):
            values[d].update(_direction_item(name, value, where))
    base = LinkConfig()
    cfg = LinkConfig(
        up=replace(DirectionConfig(), **values["up"]),
        down=replace(DirectionConfig(), **values["down"]),
        buffer_bytes=link.get("buffer", base.buffer_bytes),
        chunk_bytes=link.get("chunk", base.chunk_bytes),
    )
    try:
        return cfg.validate()
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def split_rates(text: str) -> tuple[tuple[float, float], str]:
    """A link string -> ((up, down) rate in bits per second, the string without its rates), for
    a link whose rate the kernel gives (emulated hosts) and whose delay and faults the relay does.
    The string is validated first (one line when it is bad)."""
    cfg = parse_link(text)
    items = [t.strip() for t in text.split(",") if t.strip()]
    kept = [raw for raw in items if _item(raw, text)[0].rpartition(".")[2] != "rate"]
    return (cfg.up.rate_bps, cfg.down.rate_bps), ",".join(kept)


def _item(raw: str, where: str) -> tuple[str, str]:
    """One item of a link string -> (its key, lower case; its value): a bare rate is ``rate``,
    a bare delay ``latency``."""
    if "=" in raw:
        key, value = (s.strip() for s in raw.split("=", 1))
        return key.lower(), value
    if _is(raw, RATE_UNITS) or raw.lower() == "inf":
        return "rate", raw
    if _is(raw, DELAY_UNITS):
        return "latency", raw
    raise ConfigError(f"{where}: {raw!r} is neither a rate nor a latency; use {LINK_SYNTAX}")


def _is(text: str, units: dict[str, float]) -> bool:
    m = _QUANTITY.match(text)
    return m is not None and m.group(3).lower() in units


def _direction_item(name: str, value: str, where: str) -> dict[str, float]:
    if name == "rate":
        return {"rate_bps": parse_rate(value, where)}
    if name in ("latency", "delay"):
        return {"latency_s": parse_delay(value, where)}
    if name == "jitter":
        return {"jitter_s": parse_delay(value, where)}
    p, sep, d = value.partition(":")
    if not sep:
        raise ConfigError(f"{where}: stall={value!r} must be PROBABILITY:DURATION, e.g. stall=0.01:200ms")
    return {"stall_prob": parse_probability(p, where), "stall_s": parse_delay(d, where)}


# ----------------------------------------------------------------------------------------------
# Faults

PartitionKind = Literal["hold", "cut"]
FAULT_SYNTAX = "hold:DURATION@TIME, cut:DURATION@TIME, reset_every:PERIOD, reset_mean:MEAN or flap:UP/DOWN"


@dataclass(frozen=True)
class Partition:
    """A timed partition of a link."""

    kind: PartitionKind
    """hold: nothing is forwarded, then everything resumes; cut: every connection is reset and
    new ones are closed at once until it ends."""
    start_s: float
    """When it starts, in seconds on the relay's clock (since the run started)."""
    duration_s: float
    """How long it lasts."""

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True)
class LinkFaults:
    """What happens to a link over time, besides its shape."""

    partitions: tuple[Partition, ...] = ()
    """Timed holds and cuts."""
    reset_every_s: float = 0.0
    """Reset every connection every this many seconds (0: never)."""
    reset_mean_s: float = 0.0
    """Reset every connection at Poisson times with this mean gap (0: never)."""
    flap_up_s: float = 0.0
    """Flapping: up this long, then cut ``flap_down_s``, over and over (0: no flapping)."""
    flap_down_s: float = 0.0
    """Flapping: how long each cut lasts."""

    def __bool__(self) -> bool:
        return bool(self.partitions or self.reset_every_s or self.reset_mean_s or self.flap_down_s)

    @classmethod
    def parse(cls, texts: tuple[str, ...] | list[str], horizon_s: float | None = None) -> LinkFaults:
        """Fault strings (see the module's docs) -> one LinkFaults; ``horizon_s``: the run's
        length, for times given as a percentage."""
        out = cls()
        for t in texts:
            out = out.plus(parse_fault(t, horizon_s))
        return out

    def plus(self, other: LinkFaults) -> LinkFaults:
        """Both sets of faults (a second reset or flap setting replaces the first)."""
        return LinkFaults(
            partitions=tuple(sorted((*self.partitions, *other.partitions), key=lambda p: p.start_s)),
            reset_every_s=other.reset_every_s or self.reset_every_s,
            reset_mean_s=other.reset_mean_s or self.reset_mean_s,
            flap_up_s=other.flap_up_s or self.flap_up_s,
            flap_down_s=other.flap_down_s or self.flap_down_s,
        )


def parse_fault(text: str, horizon_s: float | None = None) -> LinkFaults:
    """One fault string -> LinkFaults; a malformed one raises ConfigError in one line."""
    where = f"link fault {text!r}"
    kind, sep, arg = (s.strip() for s in text.strip().partition(":"))
    if not sep or not arg:
        raise ConfigError(f"{where} is malformed; use {FAULT_SYNTAX}")
    if kind in ("hold", "cut"):
        duration, at, when = (s.strip() for s in arg.partition("@"))
        if not at or not when:
            raise ConfigError(f"{where}: a {kind} needs its start, e.g. {kind}:30s@40% or {kind}:30s@120s")
        d = _positive_delay(duration, where)
        if when.endswith("%"):
            if horizon_s is None:
                raise ConfigError(f"{where}: a start in % of the run needs the run's length; give it in seconds")
            frac = parse_probability(when, where)
            require(frac < 1.0, f"{where} start", when, "0% .. <100% of the run")
            start = frac * horizon_s
        else:
            start = parse_delay(when, where)
        return LinkFaults(partitions=(Partition(kind, start, d),))  # type: ignore[arg-type]
    if kind == "reset_every":
        return LinkFaults(reset_every_s=_positive_delay(arg, where))
    if kind == "reset_mean":
        return LinkFaults(reset_mean_s=_positive_delay(arg, where))
    if kind == "flap":
        up, slash, down = arg.partition("/")
        if not slash:
            raise ConfigError(f"{where}: flap needs UP/DOWN, e.g. flap:10s/5s")
        return LinkFaults(flap_up_s=_positive_delay(up, where), flap_down_s=_positive_delay(down, where))
    raise ConfigError(f"{where}: unknown kind {kind!r}; use {FAULT_SYNTAX}")


def _positive_delay(text: str, where: str) -> float:
    d = parse_delay(text, where)
    require(d > 0, f"{where} duration", text, "> 0")
    return d


def split_learner(text: str, num_learners: int, key: str) -> tuple[int, str]:
    """'LEARNER:REST' (a chaos entry) -> (learner, REST); one line when malformed or out of range."""
    head, sep, rest = text.partition(":")
    try:
        m = int(head)
    except ValueError:
        m = -1
    if not sep or not rest.strip() or m < 0:
        raise ConfigError(f"{key} entry {text!r} is malformed; use 'LEARNER:...', e.g. '1:10mbit,50ms'")
    if m >= num_learners:
        raise ConfigError(f"{key} entry {text!r}: learner {m} is out of range; allowed: 0 .. {num_learners - 1}")
    return m, rest.strip()


def parse_site_rate(text: str) -> float:
    """The aggregate cap of a site link: a rate ('100mbit'), shared by each direction's traffic."""
    return parse_rate(text, f"site link {text!r}")
