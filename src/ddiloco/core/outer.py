"""The outer optimizer of one fragment: SGD with Nesterov momentum on merged outer gradients."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class OuterNesterov:
    """SGD with Nesterov momentum, step for step equal to ``torch.optim.SGD(nesterov=True)``.

    The outer gradient is ``Theta - theta`` (old global minus learner value), so a step with
    lr 1 and momentum 0 moves the global values exactly onto the merged learner values.
    """

    def __init__(self, lr: float, momentum: float) -> None:
        self.lr = lr
        self.momentum = momentum
        self.buffers: list[torch.Tensor] | None = None

    def step(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Return the new parameter values. ``params`` are not modified; ``grads`` are used as
        scratch space and overwritten (the syncer hands over its merge buffers)."""
        if self.momentum > 0:
            if self.buffers is None:
                # torch's SGD starts the buffer at the first gradient, not at zero.
                self.buffers = [g.detach().clone() for g in grads]
            else:
                for b, g in zip(self.buffers, grads):
                    torch.add(g, b, alpha=self.momentum, out=b)  # b = momentum * b + g, in one pass
            # the same operations as torch.optim.SGD(nesterov=True), in place of the gradient
            for g, b in zip(grads, self.buffers):
                g.add_(b, alpha=self.momentum)
        return [torch.add(p, g, alpha=-self.lr) for p, g in zip(params, grads)]

    def state_dict(self) -> dict[str, list[torch.Tensor] | None]:
        """The momentum buffers (lr and momentum come from the config, not the state)."""
        return {"buffers": None if self.buffers is None else [b.clone() for b in self.buffers]}

    def load_state_dict(self, state: dict[str, list[torch.Tensor] | None]) -> None:
        bufs = state["buffers"]
        self.buffers = None if bufs is None else [b.float().clone() for b in bufs]
