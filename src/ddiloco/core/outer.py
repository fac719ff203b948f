"""The outer optimizer of one fragment: SGD with Nesterov momentum on merged outer gradients."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class OuterNesterov:
    """SGD with Nesterov momentum, step for step equal to ``torch.optim.SGD(nesterov=True)``.

    The outer gradient is ``Theta - theta`` (old global minus learner value), so a step with
    lr 1 and momentum 0 moves the global values exactly onto the merged learner values.
    """

    def __init__(self, lr: float, momentum: float, delayed: bool = False) -> None:
        self.lr = lr
        self.momentum = momentum
        self.buffers: list[torch.Tensor] | None = None
        self.delayed = delayed
        # Delayed Nesterov: the share-weighted gradients merged since the last momentum update.
        self.pending: list[torch.Tensor] | None = None
        self.pending_share = 0.0

    def step(
        self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], share: float = 1.0
    ) -> list[torch.Tensor]:
        """Return the new parameter values. ``params`` are not modified; ``grads`` are used as
        scratch space and overwritten (the syncer hands over its merge buffers).

        ``share`` is the part of the fleet this gradient stands for (1: a whole round). Only a
        ``delayed`` optimizer uses it: see ``_delayed_step``.
        """
        if self.delayed and (share < 1.0 or self.pending is not None):
            return self._delayed_step(params, grads, share)
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

    def _delayed_step(
        self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], share: float
    ) -> list[torch.Tensor]:
        """Delayed Nesterov: move by ``lr * share * g`` now, and update the momentum (and add its
        push) once the merged shares reach a whole fleet, with their share-weighted mean.

        With share 1 every time this is exactly the Nesterov step ``lr * (g + momentum * b)``,
        ``b = momentum * b + g``. With K = 1 every learner's answer is its own merge; scaled by
        its share, a fleet's worth of them moves the fragment as far as one full round would,
        and the momentum sees their mean once instead of each of them amplified.
        """
        share = min(max(share, 0.0), 1.0)
        new = [torch.add(p, g, alpha=-self.lr * share) for p, g in zip(params, grads)]
        if self.pending is None:
            self.pending = [g.mul(share) for g in grads]
        else:
            for acc, g in zip(self.pending, grads):
                acc.add_(g, alpha=share)
        self.pending_share += share
        if self.pending_share < 1.0 - 1e-9:
            return new
        mean = [acc.div_(self.pending_share) for acc in self.pending]
        self.pending, self.pending_share = None, 0.0
        if self.momentum <= 0:
            return new
        if self.buffers is None:
            self.buffers = mean  # as torch's SGD: the buffer starts at the first gradient
        else:
            for b, g in zip(self.buffers, mean):
                torch.add(g, b, alpha=self.momentum, out=b)
        for p, b in zip(new, self.buffers):
            p.add_(b, alpha=-self.lr * self.momentum)
        return new

    def state_dict(self) -> dict[str, list[torch.Tensor] | None]:
        """The momentum buffers (lr and momentum come from the config, not the state)."""
        return {"buffers": None if self.buffers is None else [b.clone() for b in self.buffers]}

    def load_state_dict(self, state: dict[str, list[torch.Tensor] | None]) -> None:
        bufs = state["buffers"]
        self.buffers = None if bufs is None else [b.float().clone() for b in bufs]
