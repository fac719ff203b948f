"""Handing an inner optimizer's state to a rejoining learner, so its first steps are warm.

The state travels as tensors named 'INDEX.KEY' (e.g. '3.exp_avg') plus the param_groups, over
the wire format (no pickle), from a live peer through the syncer.

What a peer sends is data, never settings: ``load_state`` takes only the state tensors (the
moments and the step count) and keeps the receiver's own hyper-parameters (lr, weight decay,
betas, eps, ...), and it refuses, leaving the optimizer as it was, a state that does not fit
the receiver's parameters or holds values no honest optimizer could reach.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from ddiloco.protocol.handoff import PIECE, range_name, tensor_bytes
from ddiloco.protocol.messages import PeerState

MAX_STEP = 2**53
"""Largest step count taken (a float64 still counts it exactly)."""
MOMENT_SLACK = 1.1
"""Rounding room on the Adam bound |exp_avg| <= c * sqrt(exp_avg_sq) (``_moment_bound``)."""


def state_message(opt: torch.optim.Optimizer, to: int, source: int) -> PeerState:
    """``opt``'s state as a message for learner ``to``."""
    sd = opt.state_dict()
    tensors = {
        f"{i}.{k}": v.detach().cpu().clone()
        for i, st in sd["state"].items()
        for k, v in st.items()
        if isinstance(v, torch.Tensor)
    }
    return PeerState(to, source, sd["param_groups"], tensors)


class StateServer:
    """An optimizer state handed to a peer a piece per step boundary, never copied whole: each
    ``piece(budget_bytes)`` copies about that much state (the session's budget:
    ``protocol.handoff.HandoffPace``), parameter after parameter in the optimizer's order. A
    parameter whose state does not fit goes as ranges of rows (dim 0) over several boundaries,
    its moments' same rows copied together (so they are of one step), under the names
    ``protocol.handoff.range_name`` gives; its step count and any state of another shape go
    with its first range. At least one row goes per piece. The pieces
    (``protocol.handoff.PIECE``) end with one carrying the param_groups.

    ``clock``: a driver that measures how long each copy takes hands its clock (a copy from an
    accelerator is timed after the device finished the step: what the copy costs, not what the
    step still had queued); ``copy_s`` is then the last piece's copy time (0 without one)."""

    def __init__(
        self, opt: torch.optim.Optimizer, to: int, source: int, clock: Callable[[], float] | None = None
    ) -> None:
        self.opt, self.to, self.source, self.clock = opt, to, source, clock
        self._next = 0  # the parameter (position in the state) under way
        self._row = 0  # its next row (0: none of it went yet)
        self._index = 0
        self.copy_s = 0.0
        """Seconds the last piece's copy took (0: not measured)."""

    @property
    def done(self) -> bool:
        return self._next < 0

    def piece(self, budget_bytes: int) -> PeerState | None:
        """About ``budget_bytes`` of state (None once the last piece went)."""
        if self.done:
            return None
        sd = self.opt.state_dict()  # (references to the live tensors: copied below, a few at a time)
        ids = list(sd["state"])  # the optimizer's own order (stable: a state made later goes last)
        started = self._started(sd["state"].values())
        tensors: dict[str, torch.Tensor] = {}
        size = 0
        while self._next < len(ids) and (not tensors or size < budget_bytes):
            i = ids[self._next]
            items = {k: v for k, v in sd["state"][i].items() if isinstance(v, torch.Tensor)}
            got = self._take(i, items, budget_bytes - size, first=not tensors)
            if got is None:
                break
            tensors.update(got)
            size += tensor_bytes(got)
        if started is not None and self.clock is not None:
            self.copy_s = self.clock() - started
        if self._next < len(ids):
            self._index += 1
            return PeerState(self.to, self.source, [{PIECE: self._index - 1}], tensors)
        self._next = -1
        return PeerState(self.to, self.source, sd["param_groups"], tensors)

    def _started(self, states: Iterable[dict[str, object]]) -> float | None:
        """When the copy starts (after an accelerator finished what it had queued), by ``clock``."""
        if self.clock is None:
            return None
        for st in states:
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                    torch.cuda.synchronize(v.device)
                    return self.clock()
        return self.clock()

    def _take(self, i: int, items: dict[str, torch.Tensor], room: int, first: bool) -> dict[str, torch.Tensor] | None:
        """Copies of parameter ``i``'s state, or of its next rows, within ``room`` bytes (at least
        one row when ``first``); None when not even that fits."""
        ranged = _row_tensors(items)
        whole = tensor_bytes(items)
        if self._row == 0 and (whole <= room or not ranged):
            if not first and whole > room:
                return None
            self._next += 1
            return {f"{i}.{k}": _host_copy(v) for k, v in items.items()}
        rows = next(iter(ranged.values())).shape[0]
        row_bytes = sum(v[0].numel() * v.element_size() for v in ranged.values())
        rest = whole - rows * row_bytes if self._row == 0 else 0  # what goes with the first range
        take = min(rows - self._row, max(1 if first else 0, (room - rest) // max(1, row_bytes)))
        if take <= 0:
            return None
        lo, hi = self._row, self._row + take
        out = {f"{i}.{k}": _host_copy(v) for k, v in items.items() if k not in ranged and lo == 0}
        out.update({range_name(f"{i}.{k}", lo, hi, rows): _host_copy(v[lo:hi]) for k, v in ranged.items()})
        self._row = hi
        if hi == rows:
            self._next, self._row = self._next + 1, 0
        return out


def _row_tensors(items: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A parameter's state tensors that go by rows: those with the rows (dim 0, more than one) of
    its largest one (AdamW: both moments; the step count goes whole)."""
    big = max(items.values(), key=lambda v: v.numel(), default=None)
    if big is None or big.dim() == 0 or big.shape[0] <= 1:
        return {}
    return {k: v for k, v in items.items() if v.dim() > 0 and v.shape[0] == big.shape[0]}


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in host memory, a copy of their own (one copy, from any device)."""
    return t.detach().to("cpu", copy=True)


def _moment_bound(group: dict[str, object]) -> float | None:
    """For Adam-like betas: the most |exp_avg| can exceed sqrt(exp_avg_sq) by, whatever the
    gradients (Cauchy-Schwarz on the two moving averages: (1-b1) / sqrt((1-b2)(1-b1^2/b2)),
    about 7.3 for the defaults). None when the group has no such betas."""
    betas = group.get("betas")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        return None
    b1, b2 = (float(b) for b in betas)
    if not (0.0 <= b1 < 1.0 and 0.0 < b2 < 1.0) or b1 * b1 >= b2:
        return None
    return (1.0 - b1) / math.sqrt((1.0 - b2) * (1.0 - b1 * b1 / b2))


CHECK_CHUNK = 1 << 20
"""Values per float64 check at a time: the bound is checked in double precision, and a whole
moment tensor of a large model in float64 would cost four times its size at once."""


def _exceeds(m: torch.Tensor, v: torch.Tensor, factor: float) -> bool:
    """Whether |m| > factor * sqrt(v) anywhere (in float64, chunk by chunk)."""
    fm, fv = m.reshape(-1), v.reshape(-1)
    for s in range(0, fm.numel(), CHECK_CHUNK):
        limit = fv[s : s + CHECK_CHUNK].double().sqrt_().mul_(factor).add_(1e-30)
        if bool((fm[s : s + CHECK_CHUNK].double().abs_() > limit).any()):
            return True
    return False


def check_state(opt: torch.optim.Optimizer, msg: PeerState) -> tuple[dict[int, dict[str, torch.Tensor]], str | None]:
    """The state of ``msg`` by parameter index, and why it cannot be loaded into ``opt`` (None:
    it can): every key names one of ``opt``'s parameters; every parameter's tensors have one
    set of names; moments have the parameter's shape, a floating dtype and finite values
    (second moments non-negative, first moments within the Adam bound of the second); a step
    count is one finite, whole, non-negative number."""
    params = [p for g in opt.param_groups for p in g["params"]]
    groups = [g for g in opt.param_groups for _ in g["params"]]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in msg.tensors.items():
        idx, _, name = key.partition(".")
        if not (idx.isascii() and idx.isdigit()) or not name or int(idx) >= len(params):
            return {}, f"state key {key!r} names no parameter of this optimizer ({len(params)} parameters)"
        state.setdefault(int(idx), {})[name] = t
    names = {frozenset(st) for st in state.values()}
    if len(names) > 1:
        return {}, f"parameters carry different state names: {sorted(sorted(n) for n in names)}"
    for i, st in state.items():
        p = params[i]
        for name, t in st.items():
            if not t.dtype.is_floating_point:
                return {}, f"state {i}.{name} has dtype {t.dtype}, not a floating-point one"
            if not bool(torch.isfinite(t).all()):
                return {}, f"state {i}.{name} holds non-finite values"
            if name == "step":
                if t.numel() != 1 or not 0 <= float(t) <= MAX_STEP or float(t) != math.floor(float(t)):
                    return {}, f"state {i}.step is not one whole number in [0, 2^53]"
            elif tuple(t.shape) != tuple(p.shape):
                return {}, f"state {i}.{name} has shape {tuple(t.shape)}, the parameter {tuple(p.shape)}"
            elif name.endswith("_sq") and bool((t < 0).any()):
                return {}, f"state {i}.{name} holds negative values (a second moment cannot)"
        bound = _moment_bound(groups[i])
        m, v = st.get("exp_avg"), st.get("exp_avg_sq")
        if bound is not None and m is not None and v is not None and _exceeds(m, v, MOMENT_SLACK * bound):
            return {}, f"state {i}.exp_avg exceeds {bound:.3g} x sqrt(exp_avg_sq): no gradients give that"
    return state, None


def load_state(opt: torch.optim.Optimizer, msg: PeerState, device: torch.device) -> str | None:
    """Load a peer's state tensors into ``opt``, keeping ``opt``'s own hyper-parameters; the
    reason when it is refused (then ``opt`` is unchanged)."""
    state, problem = check_state(opt, msg)
    if problem is not None:
        return problem
    moved = {i: {k: t.to(device) if k != "step" else t for k, t in st.items()} for i, st in state.items()}
    # Our own param_groups: a peer may hand over what it learned, never how we learn.
    own = opt.state_dict()["param_groups"]
    # Our own (cold) moments go first: holding both while the peer's load would be twice the
    # state at once. (A load that fails after the checks leaves the optimizer cold.)
    opt.state.clear()
    try:
        opt.load_state_dict({"state": moved, "param_groups": own})
    except (ValueError, KeyError, RuntimeError, TypeError) as e:
        return str(e)
    return None
