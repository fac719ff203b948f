"""One executor of a step boundary's plan, for every driver: ``BoundaryExecutor``.

The session plans a boundary (``LearnerSession.step`` or ``boundary`` returns a
``BoundaryPlan``); only the driver can touch the model. This carries the plan out, in its one
order, and hands the result back to the session (``complete``):

1. add the eager moves and write the arrived global fragments into the model, by one rule
   (``write``: a move adds; an update overwrites when ``Receipt.alpha`` is 0, blends when it is
   > 0, adds when its mode is "shift");
2. load a live peer's optimizer state, when the plan carries one with tensors;
3. read the fragments in ``plan.read`` to host memory;
4. serve this learner's optimizer state to each learner in ``plan.serve``: a piece per
   boundary (a ``StateSource`` per asker, kept until it is done), never copied whole: the
   session's budget (``LearnerSession.serve_budget``: sized by the link and the step time,
   nothing while the driver still holds unsent pieces), shared by the hand-offs under way;
   the driver's comm thread sends the pieces while training goes on;
5. ``session.complete`` with the values read and the pieces served (with the seconds their copy
   took, as the driver measured): the messages to send.

What differs between drivers is handed in as a ``BoundaryHost``: the simulator writes CPU
tensors; ``ddiloco.Learner`` uploads on a side stream, writes only its rows of an FSDP2
parameter, and takes the session's lock. Nothing here reads a clock, logs or touches a socket.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Protocol

import torch

from ddiloco.protocol.handoff import handoff_nbytes
from ddiloco.protocol.learner_session import BoundaryPlan, LearnerOutput, LearnerSession
from ddiloco.protocol.messages import PeerState


class StateSource(Protocol):
    """An optimizer state handed to one peer in pieces (``training.peer_state.StateServer``)."""

    @property
    def done(self) -> bool:
        """The last piece went."""
        ...

    @property
    def copy_s(self) -> float:
        """Seconds the last piece's copy took, as the driver measured (0: not measured)."""
        ...

    def piece(self, budget_bytes: int) -> PeerState | None:
        """This boundary's piece: about ``budget_bytes`` of state (at least one row of a
        tensor); None once the last one went."""
        ...


class BoundaryHost(Protocol):
    """What only the driver can do at a boundary: touch its model and optimizer."""

    def write(self, p: int, values: Sequence[torch.Tensor], alpha: float, add: bool) -> None:
        """Write fragment p's values into the model (``core.fragments.write_fragment``'s rule)."""
        ...

    def read(self, p: int) -> list[torch.Tensor]:
        """Fragment p's current values, in host memory."""
        ...

    def load_peer_state(self, state: PeerState) -> None:
        """Load a live peer's optimizer state (the driver checks and logs it)."""
        ...

    def serve(self, learner: int) -> StateSource | None:
        """This learner's optimizer state for ``learner``, in pieces (None: it has none to give)."""
        ...


class BoundaryExecutor:
    """Carries out one learner process's boundary plans (one per process: its hand-offs under
    way belong to it)."""

    def __init__(self, host: BoundaryHost) -> None:
        self.host = host
        self.serving: list[StateSource] = []
        """Optimizer hand-offs under way, a piece per boundary."""

    def write(self, plan: BoundaryPlan) -> None:
        """Steps 1 and 2: the moves, the arrived fragments (in arrival order), a peer's state."""
        for p, move in plan.move:
            self.host.write(p, move, 0.0, True)
        for u, receipt in plan.apply:
            self.host.write(u.fragment, u.values, receipt.alpha, receipt.mode == "shift")
        ps = plan.peer_state
        if ps is not None and ps.source >= 0 and ps.tensors:  # an empty state is a refusal: train on cold
            self.host.load_peer_state(ps)

    def read(self, plan: BoundaryPlan) -> dict[int, list[torch.Tensor]]:
        """Step 3: the host copy of each fragment the session needs."""
        return {p: self.host.read(p) for p in plan.read}

    def serve(self, plan: BoundaryPlan, budget_bytes: int) -> tuple[list[PeerState], float]:
        """Step 4: this boundary's piece of every hand-off under way (new askers start now),
        ``budget_bytes`` in all, shared evenly (0: none this boundary); and the seconds the
        copies took."""
        self.serving += [src for who in plan.serve if (src := self.host.serve(who)) is not None]
        states: list[PeerState] = []
        copy_s, left = 0.0, budget_bytes
        for i, src in enumerate(self.serving):
            share = left // (len(self.serving) - i)
            piece = src.piece(share) if share > 0 else None
            if piece is not None:
                states.append(piece)
                left -= handoff_nbytes(piece)
                copy_s += src.copy_s
        self.serving = [src for src in self.serving if not src.done]
        return states, copy_s

    def run(
        self,
        plan: BoundaryPlan,
        session: LearnerSession | None,
        *,
        read: bool = True,
        lock: contextlib.AbstractContextManager[object] | None = None,
    ) -> LearnerOutput | None:
        """The whole boundary; the messages to send (None without a session: a torchrun rank
        other than 0 writes and joins the gathers, but sends nothing). ``read``: this process
        reads the fragments (a rank that neither sends nor gathers skips them); ``lock``: held
        around ``complete`` (a comm thread shares the session)."""
        self.write(plan)
        values = self.read(plan) if read else {}
        if session is None:
            return None
        guard = lock if lock is not None else contextlib.nullcontext()
        budget = 0
        if self.serving or plan.serve:
            with guard:
                budget = session.serve_budget()
        states, copy_s = self.serve(plan, budget)
        with guard:
            return session.complete(plan, values, states, copy_s)
