"""The outer optimizer of one fragment: SGD with Nesterov momentum on merged outer gradients."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ddiloco.core.merge import spans


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
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        share: float = 1.0,
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Return the new parameter values. ``params`` are not modified; ``grads`` are used as
        scratch space and overwritten (the syncer hands over its merge buffers).

        ``share`` is the part of the fleet this gradient stands for (1: a whole round). Only a
        ``delayed`` optimizer uses it: see ``_delayed_step``.

        ``out``: tensors of the parameters' shapes to write the new values into (a caller that
        recycles a version nobody holds any more saves the allocation and its page faults);
        None allocates them.
        """
        if self.delayed and (share < 1.0 or self.pending is not None):
            return self._delayed_step(params, grads, share)
        if out is not None and len(out) != len(params):
            raise ValueError(f"out has {len(out)} tensors for {len(params)} parameters")
        if out is None:
            out = [
                torch.empty(p.shape, dtype=torch.promote_types(p.dtype, g.dtype), device=p.device)
                for p, g in zip(params, grads)
            ]
        new = list(out)
        first = self.momentum > 0 and self.buffers is None
        if first:  # torch's SGD starts the buffer at the first gradient, not at zero
            self.buffers = [g.detach().clone() for g in grads]
        for i, (p, g) in enumerate(zip(params, grads)):
            b = self.buffers[i] if self.momentum > 0 and self.buffers is not None else None
            self._chunked(p, g, b, new[i], first)
        return new

    def _chunked(
        self, p: torch.Tensor, g: torch.Tensor, b: torch.Tensor | None, new: torch.Tensor, first: bool
    ) -> None:
        """One tensor's step, chunk by chunk so that each chunk is read from memory once. The
        operations are element-wise, so the chunking changes no bit."""
        if not all(t.is_contiguous() for t in (g, new) + (() if b is None else (b,))):
            self._apply(p, g, b, new, first)  # no flat views: the tensor as one chunk
            return
        pf, gf, nf = p.reshape(-1), g.view(-1), new.view(-1)
        bf = None if b is None else b.view(-1)
        for s, e in spans(gf.numel()):
            self._apply(pf[s:e], gf[s:e], None if bf is None else bf[s:e], nf[s:e], first)

    def _apply(self, p: torch.Tensor, g: torch.Tensor, b: torch.Tensor | None, new: torch.Tensor, first: bool) -> None:
        """The operations of torch.optim.SGD(nesterov=True), with the gradient as scratch."""
        if b is not None:
            if not first:
                torch.add(g, b, alpha=self.momentum, out=b)  # b = momentum * b + g, in one pass
            g.add_(b, alpha=self.momentum)
        torch.add(p, g, alpha=-self.lr, out=new)

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

    def load_state_dict(self, state: dict[str, list[torch.Tensor] | None], take: bool = False) -> None:
        """``take``: the tensors are this optimizer's to keep and update in place (not copied)."""
        bufs = state["buffers"]
        self.buffers = None if bufs is None else [b.float() if take else b.float().clone() for b in bufs]
