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

import torch

from ddiloco.protocol.learner_session import PIECE
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


SERVE_BYTES_PER_BOUNDARY = 32 << 20
"""What a learner serving its optimizer state copies at one step boundary (``StateServer``)."""


class StateServer:
    """An optimizer state handed to a peer a few parameters per step boundary, not copied whole:
    each boundary copies at most ``budget_bytes`` of state (a parameter's tensors together, so
    its moments and step count are of one step; a parameter larger than the budget goes alone),
    and the pieces (``learner_session.PIECE``) end with one carrying the param_groups. A copy of
    the whole state would cost the serving learner twice the model at once (AdamW)."""

    def __init__(self, opt: torch.optim.Optimizer, to: int, source: int, budget_bytes: int) -> None:
        self.opt, self.to, self.source, self.budget = opt, to, source, budget_bytes
        self._next = 0
        self._index = 0

    @property
    def done(self) -> bool:
        return self._next < 0

    def piece(self) -> PeerState | None:
        """This boundary's piece (None once the last one went)."""
        if self.done:
            return None
        sd = self.opt.state_dict()  # (references to the live tensors: copied below, a few at a time)
        ids = list(sd["state"])  # the optimizer's own order (stable: a state made later goes last)
        tensors: dict[str, torch.Tensor] = {}
        size = 0
        while self._next < len(ids) and (not tensors or size < self.budget):
            i = ids[self._next]
            items = {k: v for k, v in sd["state"][i].items() if isinstance(v, torch.Tensor)}
            n = sum(v.numel() * v.element_size() for v in items.values())
            if tensors and size + n > self.budget:
                break
            tensors.update({f"{i}.{k}": v.detach().cpu().clone() for k, v in items.items()})
            size += n
            self._next += 1
        if self._next < len(ids):
            self._index += 1
            return PeerState(self.to, self.source, [{PIECE: self._index - 1}], tensors)
        self._next = -1
        return PeerState(self.to, self.source, sd["param_groups"], tensors)


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
        if not idx.isdigit() or not name or int(idx) >= len(params):
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
