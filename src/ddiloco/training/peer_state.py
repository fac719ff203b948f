"""Handing an inner optimizer's state to a rejoining learner, so its first steps are warm.

The state travels as tensors named 'INDEX.KEY' (e.g. '3.exp_avg') plus the param_groups, over
the wire format (no pickle), from a live peer through the syncer.
"""

from __future__ import annotations

import torch

from ddiloco.protocol.messages import PeerState


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


def load_state(opt: torch.optim.Optimizer, msg: PeerState, device: torch.device) -> str | None:
    """Load a peer's state into ``opt``; the reason when it does not fit (then ``opt`` is unchanged)."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in msg.tensors.items():
        idx, _, name = key.partition(".")
        if not idx.isdigit() or not name:
            return f"bad state key {key!r}"
        state.setdefault(int(idx), {})[name] = t.to(device) if name != "step" else t
    try:
        opt.load_state_dict({"state": state, "param_groups": msg.param_groups})
    except (ValueError, KeyError, RuntimeError, TypeError) as e:
        return str(e)
    return None
