"""Keeping the overlap's progress (``algo.on_merged``): what a learner adds to a fragment when a
merged version arrives, instead of overwriting the steps it trained since its contribution.

A learner sends fragment p at theta_send = Theta_base - delta and trains on for tau steps while
the round is open. When Theta_new arrives it takes

    "shift":  theta <- Theta_new + (theta - theta_send)

the merged version plus its own steps since the contribution (its contribution is in Theta_new
already: keeping all of theta - Theta_base would count it twice, and a contribution still pending
at the syncer, late for this round, would be counted twice as well). Written as a change to add
to the local values: (Theta_new - Theta_base) + delta.

    "eager":  when the contribution leaves, theta <- theta + (1 - outer_lr) * delta

moves the fragment to the learner's own guess of the next version, Theta_base - outer_lr * delta
(its outer gradient standing in for the round's mean; Kale et al. 2025, without the syncer's
momentum, which learners do not hold), so the tau steps are computed near where the merge lands.
That displacement D is taken back when the merge arrives: the change is (Theta_new - Theta_base)
+ delta - D. Between the two, a contribution is measured from the undisplaced values (values - D),
so the displacement is never sent as progress.

Parameters only: buffers and counts are levels, not progress, and take the merged values. Pure:
tensors in, tensors out; the learner session calls it and the driver adds what it returns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import Piece

NO_VALUE = torch.empty(0)
"""A move's entry for a piece it leaves alone (a buffer or a count)."""


class OverlapKeeper:
    """Per fragment: the last contribution's delta (exact, against the base the learner holds)
    and the eager displacement applied to the local values."""

    def __init__(self, cfg: DiLoCoConfig, fragments: Sequence[Sequence[Piece]]) -> None:
        self.cfg = cfg
        self.pieces = fragments
        self.sent_delta: dict[int, list[torch.Tensor]] = {}
        """Fragment -> Theta_base - theta_send of its last contribution from the current base."""
        self.displaced: dict[int, list[torch.Tensor]] = {}
        """Fragment -> D, the eager move already written into the local values."""
        self._moves: list[tuple[int, list[torch.Tensor]]] = []

    @property
    def active(self) -> bool:
        return self.cfg.on_merged != "overwrite"

    def held_bytes(self) -> int:
        """Bytes held: one delta per fragment in flight, and its displacement under eager."""
        kept = [*self.sent_delta.values(), *self.displaced.values(), *(m for _, m in self._moves)]
        return sum(t.numel() * t.element_size() for vals in kept for t in vals)

    def undisplaced(self, p: int, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Fragment p's local values without the eager displacement (what a contribution measures)."""
        d = self.displaced.get(p)
        if d is None:
            return values
        return [v - x if x.numel() else v for v, x in zip(values, d)]

    def sent(self, p: int, base: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """A contribution of p measured at ``values`` (undisplaced) from ``base`` left. Under
        eager the first one from a base plans the move to the learner's guess."""
        if not self.active:
            return
        delta = [b - v.float() if pc.kind == "param" else NO_VALUE for b, v, pc in zip(base, values, self.pieces[p])]
        self.sent_delta[p] = delta
        if self.cfg.on_merged == "eager" and p not in self.displaced and all(p != q for q, _ in self._moves):
            step = 1.0 - self.cfg.outer_lr
            self._moves.append((p, [d * step if d.numel() else NO_VALUE for d in delta]))

    def moves(self) -> list[tuple[int, list[torch.Tensor]]]:
        """The eager moves to add to the local values now (before anything is read): each is then
        part of the fragment's displacement."""
        out, self._moves = self._moves, []
        for p, m in out:
            self.displaced[p] = m
        return out

    def change(self, p: int, new: Sequence[torch.Tensor], base: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What to add to fragment p's parameters as Theta_new arrives over ``base`` (buffers and
        counts: the new values, to be written as they are)."""
        delta = self.sent_delta.pop(p, None)
        disp = self.displaced.pop(p, None)
        out = []
        for i, (n, b, pc) in enumerate(zip(new, base, self.pieces[p])):
            if pc.kind != "param":
                out.append(n)
                continue
            c = n.float() - b
            if delta is not None:
                c += delta[i]
            if disp is not None:
                c -= disp[i]
            out.append(c)
        return out

    def drop(self, p: int) -> None:
        """Fragment p was overwritten (a join or a rebase): nothing local is left to keep."""
        self.sent_delta.pop(p, None)
        self.displaced.pop(p, None)
        self._moves = [(q, m) for q, m in self._moves if q != p]
