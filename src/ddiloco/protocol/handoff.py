"""The optimizer hand-off's rules, for both drivers: how a live peer serves its optimizer state
(AdamW: twice the model) to a learner that starts without one, and how that learner takes it.

- **Pacing** (``HandoffPace``): what the serving learner copies at one step boundary is sized by
  what its link can carry until the next boundaries, not by a fixed amount: the link's rate (the
  bytes of the hand-off its driver put on the link per second, measured by the driver and handed
  in as a value) x its step time x ``HORIZON_STEPS``, between a floor and a ceiling
  (``runtime.peer_state_buffer_mb``), less what is still waiting to be sent (backpressure: while
  the driver holds that much unsent, nothing more is copied, so the copies held stay within the
  ceiling), and never more than the copy itself can do in ``runtime.peer_state_copy_share`` of a
  step (the copy rate measured by the driver) or 8 x the last boundary's copy. The driver's
  comm thread sends the pieces while training goes on. So a hand-off takes about its bytes / the
  link's rate, whatever the step time.
- **Messages** (``peer_state_chunks``): each at most about ``runtime.peer_state_chunk_mb``. A
  tensor larger than that (or than a boundary's budget) goes as ranges of its rows (dim 0), each
  named ``INDEX.KEY@LO:HI/ROWS`` (rows LO..HI of a tensor of ROWS rows; ``range_name``), so no
  parameter forces one giant copy or message; the receiver puts them back together.
- **Taking it** (``Reassembly``): the receiver's checks, as strict for a piece as for a whole
  state: a range outside its tensor, a range that overlaps one already taken, a piece whose rows,
  dtype or row shape disagree with its range or its tensor's earlier ranges, a name given twice,
  or more values than any optimizer of this model keeps (counted when a tensor is first named,
  before it is allocated) drops the whole state; so does a state whose last message comes while
  a tensor still lacks rows.

Pure: no clock, no socket; the time and the driver's measurements are handed in.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from ddiloco.protocol.messages import PeerState

PIECE = "ddiloco_piece"
"""Marks a piece of an optimizer state that more pieces follow: its param_groups are only
``[{PIECE: index}]`` (the last piece carries the real ones; a receiver loads its own anyway)."""
MIB = 1 << 20
FLOOR_BYTES = 4 * MIB
"""The least a serving learner copies at a boundary while a hand-off is under way and its link
has room (or before its driver has measured anything): progress, and the first measurement.
Never more than the ceiling (``runtime.peer_state_buffer_mb``)."""
HORIZON_STEPS = 2.0
"""The link time, in steps of the serving learner, that a boundary tops the unsent hand-off bytes
up to: the link stays busy until the next boundary even when a step runs long."""
SMOOTHING = 0.5
"""Weight of the newest measurement in the step time and copy rate the pace keeps."""
GROWTH = 8.0
"""A boundary copies at most this many times what the last one that copied did (at least the
floor): the copy rate is measured at each size before a larger one, and a rate measured too high
(a burst the kernel's and a relay's buffers took at once) grows the copies step by step only."""
RANGE = "@"
"""Separates a state tensor's name from the rows a piece carries (``range_name``)."""
MAX_ROWS = 2**31
"""The most rows a tensor sent by ranges may have (the wire's largest dimension)."""


def is_piece(msg: PeerState) -> bool:
    """``msg`` is a piece of an optimizer state that more pieces follow (``peer_state_chunks``)."""
    return len(msg.param_groups) == 1 and set(msg.param_groups[0]) == {PIECE}


def tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """The bytes of the values of ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def handoff_nbytes(msg: PeerState) -> int:
    """The bytes a hand-off message moves (its tensors': both drivers count with this)."""
    return tensor_bytes(msg.tensors)


def range_name(name: str, lo: int, hi: int, rows: int) -> str:
    """The name of rows ``lo``..``hi`` of the state tensor ``name``, which has ``rows`` rows."""
    return f"{name}{RANGE}{lo}:{hi}/{rows}"


def parse_range(key: str) -> tuple[str, int, int, int] | str | None:
    """``key`` as (name, lo, hi, rows) when it names a range of rows, None when it names a
    whole tensor, or why it is not a valid range (a name with ``RANGE`` in it is a range)."""
    name, sep, rest = key.rpartition(RANGE)
    if not sep:
        return None
    span, _, total = rest.partition("/")
    lo, _, hi = span.partition(":")
    if not name or not all(x.isascii() and x.isdigit() and len(x) <= 10 for x in (lo, hi, total)):
        return f"{key!r} is not NAME@LO:HI/ROWS"
    a, b, n = int(lo), int(hi), int(total)
    if not 0 <= a < b <= n <= MAX_ROWS:
        return f"{key!r}: rows {a}..{b} are not a range within {n} rows (at most {MAX_ROWS})"
    return name, a, b, n


def _split(key: str, t: torch.Tensor, limit_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``t`` as views of at most ``limit_bytes`` each, by rows (at least one row each); a tensor
    that fits, or has no rows to split, goes whole (under its own name)."""
    nbytes = t.numel() * t.element_size()
    if nbytes <= limit_bytes or t.dim() == 0 or t.shape[0] <= 1:
        yield key, t
        return
    parsed = parse_range(key)
    name, base, rows = (parsed[0], parsed[1], parsed[3]) if isinstance(parsed, tuple) else (key, 0, t.shape[0])
    step = max(1, limit_bytes // max(1, nbytes // t.shape[0]))
    for a in range(0, t.shape[0], step):
        b = min(t.shape[0], a + step)
        yield range_name(name, base + a, base + b, rows), t[a:b]


def peer_state_chunks(ps: PeerState, limit_bytes: int) -> list[PeerState]:
    """``ps`` as messages of at most about ``limit_bytes`` each (a tensor larger than that as
    ranges of its rows, ``range_name``; one row larger still goes alone), the param_groups in
    the last: on a thin link each crosses within the liveness timeouts (any message is
    liveness), and the syncer's relay timeout follows the pieces. Views, not copies."""
    pieces: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in ps.tensors.items():
        for name, part in _split(key, t, limit_bytes):
            n = part.numel() * part.element_size()
            if pieces[-1] and size + n > limit_bytes:
                pieces.append({})
                size = 0
            pieces[-1][name] = part
            size += n
    *first, last = pieces
    marked = [PeerState(ps.learner, ps.source, [{PIECE: i}], p) for i, p in enumerate(first)]
    return [*marked, PeerState(ps.learner, ps.source, ps.param_groups, last)]


@dataclass
class HandoffPace:
    """What a serving learner may copy at its next boundary (``budget``), from what its driver
    measured: a pure account, kept by the learner's session."""

    ceiling: int
    """The most copied state held unsent, in bytes (``runtime.peer_state_buffer_mb``)."""
    copy_share: float
    """The most of a step one boundary's copy may take (``runtime.peer_state_copy_share``)."""
    step_s: float = 0.0
    """The learner's step time, smoothed (0: no step yet)."""
    rate: float = 0.0
    """Bytes per second the driver put hand-off messages on the link at, lately (0: not known)."""
    copy_rate: float = 0.0
    """Bytes per second a boundary's copy of the state ran at, smoothed (0: not measured)."""
    emitted: int = 0
    """Bytes of hand-off messages this session handed its driver (``handoff_nbytes``)."""
    done: int = 0
    """Of them, bytes the driver has put on the link or dropped, as it last said."""
    last_copy: int = 0
    """Bytes the last boundary that copied copied."""
    reported: bool = False
    """Whether the driver says anything about its link (else ``unsent`` is taken as 0)."""

    @property
    def floor(self) -> int:
        return min(FLOOR_BYTES, self.ceiling)

    @property
    def unsent(self) -> int:
        """Hand-off bytes the driver still holds (0 from a driver that never said)."""
        return max(0, self.emitted - self.done) if self.reported else 0

    def stepped(self, duration_s: float) -> None:
        """One step of ``duration_s`` (its boundary included)."""
        if duration_s > 0 and math.isfinite(duration_s):
            self.step_s = duration_s if self.step_s <= 0 else _mix(self.step_s, duration_s)

    def copied(self, nbytes: int, seconds: float) -> None:
        """A boundary copied ``nbytes`` of state in ``seconds`` (0: not measured)."""
        if nbytes > 0:
            self.last_copy = nbytes
        if nbytes > 0 and seconds > 0 and math.isfinite(seconds):
            rate = nbytes / seconds
            self.copy_rate = rate if self.copy_rate <= 0 else _mix(self.copy_rate, rate)

    def sending(self, done: int, rate: float) -> None:
        """The driver's word: ``done`` bytes of the hand-off messages it was handed are on the
        link or dropped (a running total, this process); ``rate``: its link's bytes per second."""
        self.reported = True
        self.done = max(self.done, int(done))
        if rate > 0 and math.isfinite(rate):
            self.rate = float(rate)

    def budget(self) -> int:
        """Bytes to copy at this boundary: the unsent bytes topped up to what the link carries in
        ``HORIZON_STEPS`` steps (the floor while that is not known; at most the ceiling), and at
        most what the copy does in ``copy_share`` of a step and ``GROWTH`` x the last copy (each
        at least the floor). 0 while the unsent bytes are at that or over it: backpressure."""
        want = float(self.floor)
        if self.rate > 0 and self.step_s > 0:
            want = min(max(self.rate * self.step_s * HORIZON_STEPS, want), float(self.ceiling))
        room = int(want) - self.unsent
        if room <= 0:
            return 0
        if self.copy_rate > 0 and self.step_s > 0:
            room = min(room, max(self.floor, int(self.copy_share * self.step_s * self.copy_rate)))
        return min(room, max(self.floor, int(GROWTH * self.last_copy)))


def _mix(old: float, new: float) -> float:
    return (1.0 - SMOOTHING) * old + SMOOTHING * new


@dataclass
class _Ranged:
    """A tensor coming as ranges of rows: its buffer and the ranges taken, sorted."""

    buffer: torch.Tensor
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    rows: int = 0
    """Rows taken so far."""


class Reassembly:
    """The pieces of one optimizer state, put together as they come (``peer_state_chunks``'s
    names), within ``max_numel`` values in all."""

    def __init__(self, max_numel: int) -> None:
        self.max_numel = max_numel
        self.numel = 0
        """Values named so far (a ranged tensor counts whole from its first range)."""
        self.whole: dict[str, torch.Tensor] = {}
        self.ranged: dict[str, _Ranged] = {}

    def __len__(self) -> int:
        return len(self.whole) + len(self.ranged)

    def add(self, tensors: Mapping[str, torch.Tensor]) -> str | None:
        """Take one message's tensors; why the state must be dropped (None: taken)."""
        for key, t in tensors.items():
            parsed = parse_range(key)
            if isinstance(parsed, str):
                return parsed
            problem = self._whole(key, t) if parsed is None else self._range(*parsed, t)
            if problem is not None:
                return problem
        return None

    def _count(self, n: int, name: str) -> str | None:
        self.numel += n
        if self.numel > self.max_numel:
            return f"{name} takes it past {self.max_numel} values: more than any optimizer of this model keeps"
        return None

    def _whole(self, key: str, t: torch.Tensor) -> str | None:
        if key in self.whole or key in self.ranged:
            return f"{key!r} came twice"
        self.whole[key] = t
        return self._count(t.numel(), repr(key))

    def _range(self, name: str, lo: int, hi: int, rows: int, t: torch.Tensor) -> str | None:
        where = f"{name!r} rows {lo}..{hi}"
        if name in self.whole:
            return f"{where}: the tensor came whole too"
        if t.dim() == 0 or t.shape[0] != hi - lo:
            return f"{where}: the piece has shape {tuple(t.shape)}"
        got = self.ranged.get(name)
        if got is None:
            problem = self._count(rows * math.prod(t.shape[1:]), where)
            if problem is not None:
                return problem
            got = self.ranged[name] = _Ranged(torch.empty((rows, *t.shape[1:]), dtype=t.dtype))
        buf = got.buffer
        if buf.shape[0] != rows or buf.shape[1:] != t.shape[1:] or buf.dtype != t.dtype:
            return f"{where}: {t.dtype} rows of {tuple(t.shape[1:])}, earlier ranges {buf.dtype} of {tuple(buf.shape)}"
        i = bisect.bisect_left(got.starts, lo)
        if (i > 0 and got.ends[i - 1] > lo) or (i < len(got.starts) and got.starts[i] < hi):
            return f"{where} overlap rows already taken"
        got.starts.insert(i, lo)
        got.ends.insert(i, hi)
        got.rows += hi - lo
        buf[lo:hi].copy_(t)
        return None

    def finish(self) -> tuple[dict[str, torch.Tensor], str | None]:
        """The whole state, or why not (a tensor still lacks rows)."""
        for name, got in self.ranged.items():
            if got.rows != got.buffer.shape[0]:
                return {}, f"{name!r} came with {got.rows} of its {got.buffer.shape[0]} rows"
        return {**self.whole, **{name: got.buffer for name, got in self.ranged.items()}}, None
