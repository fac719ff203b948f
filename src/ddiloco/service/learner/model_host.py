"""``ddiloco.Learner``'s model and optimizer as the boundary executor sees them (``ModelHost``).

``protocol/boundary.py`` carries out every step boundary's plan, in both drivers; what is this
driver's own is here: on CUDA, fragments go up and down on a side stream through pinned memory
(``device_copies.py``); under FSDP2 a rank writes only its own rows of a sharded parameter and
gathers the full tensor to read it; a peer's optimizer state is checked and loaded (or refused,
with a line in the log); its own is served a piece per boundary (``StateServer``, its copies timed).
Every write goes through ``core.fragments.write_fragment``: one rule for every driver.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ddiloco.core.fragments import Piece, write_fragment
from ddiloco.errors import UsageError
from ddiloco.protocol.messages import PeerState
from ddiloco.training.peer_state import StateServer, load_state

if TYPE_CHECKING:
    from ddiloco.service.learner.device_copies import DeviceCopies

log = logging.getLogger(__name__)


def fsdp_rows(params: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """For FSDP2 (``fully_shard``): the rows of each DTensor parameter this rank holds.

    Only what FSDP2 makes is supported: a 1-D mesh over the torchrun group, each parameter
    ``Shard(0)`` (rank r holds rows [r*c, (r+1)*c) with c = ceil(rows / world)) or
    ``Replicate``. Writes go into the local rows; reads gather the full tensor."""
    rows: dict[str, tuple[int, int]] = {}
    for name, p in params.items():
        if type(p).__name__ != "DTensor":
            continue
        from torch.distributed.tensor import Replicate, Shard

        mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
        ok = mesh.ndim == 1 and len(placements) == 1 and isinstance(placements[0], (Shard, Replicate))
        if ok and isinstance(placements[0], Shard) and placements[0].dim != 0:
            ok = False
        if not ok or p.dim() == 0:
            raise UsageError(
                f"parameter {name} is a DTensor placed {placements} on a {mesh.ndim}-D mesh; ddiloco.Learner "
                "supports FSDP2's Shard(0) (or Replicate) on one mesh dimension: use fully_shard over the group"
            )
        n, width, r = p.shape[0], mesh.size(), mesh.get_local_rank()
        if isinstance(placements[0], Replicate):
            rows[name] = (0, n)
            continue
        c = -(-n // width)
        lo = min(r * c, n)
        rows[name] = (lo, min(lo + c, n))
        local = p.to_local()  # type: ignore[attr-defined]
        if local.shape[0] != rows[name][1] - lo:
            raise UsageError(f"parameter {name}: this rank holds {local.shape[0]} rows, not the expected {rows[name]}")
    return rows


class ModelHost:
    """One learner process's model (its synced tensors) and optimizer, for ``BoundaryExecutor``."""

    def __init__(
        self,
        learner: int,
        params: dict[str, torch.Tensor],
        pieces: Sequence[Sequence[Piece]],
        sharded: dict[str, tuple[int, int]],
        device: torch.device,
        optimizer: torch.optim.Optimizer | None,
        on_handoff: Callable[[PeerState], None],
    ) -> None:
        """``sharded``: this rank's rows of each FSDP2 parameter; ``on_handoff``: called with a
        peer's optimizer state once it is loaded."""
        self.learner, self.params, self.pieces, self.sharded = learner, params, pieces, sharded
        self.device, self.optimizer, self.on_handoff = device, optimizer, on_handoff
        self._copies: DeviceCopies | None = None

    @property
    def copies(self) -> DeviceCopies:
        """The side-stream copies (made at the first boundary: a learner that never syncs needs none)."""
        if self._copies is None:
            from ddiloco.service.learner.device_copies import DeviceCopies

            self._copies = DeviceCopies(self.device)
        return self._copies

    def read(self, p: int) -> list[torch.Tensor]:
        """Fragment p's current values, copied to host memory (on CUDA: on a side stream, into
        pinned memory, waited for). An FSDP2 parameter is gathered first: a collective, so every
        rank of the group calls this for the same fragments."""
        pieces = []
        for pc in self.pieces[p]:
            t = self.params[pc.name].detach()
            if pc.name in self.sharded:
                t = t.full_tensor()  # type: ignore[attr-defined]
            pieces.append(t[pc.row_start : pc.row_end] if t.dim() else t)
        return self.copies.read(p, pieces)

    def write(self, p: int, values: Sequence[torch.Tensor], alpha: float, add: bool) -> None:
        """Write fragment p's values into the model by ``write_fragment``'s rule. On CUDA they
        are uploaded on a side stream and the training stream waits for them on the GPU: no
        host sync. Of a sharded parameter only this rank's rows go up, into its local rows."""
        pieces = self.pieces[p]
        if not self.sharded:
            write_fragment(self.params, pieces, self.copies.upload(p, list(values)), alpha, add)
            return
        targets: list[tuple[Piece, tuple[int, int] | None]] = []
        mine: list[torch.Tensor] = []
        for pc, v in zip(pieces, values):
            if pc.name not in self.sharded or (add and v.numel() == 0):
                targets.append((pc, None))
                mine.append(v)
                continue
            lo, hi = self.sharded[pc.name]  # this rank's rows of the parameter
            a, b = max(pc.row_start, lo), min(pc.row_end, hi)
            if a < b:
                targets.append((pc, (a, b)))
                mine.append(v[a - pc.row_start : b - pc.row_start])
        with torch.no_grad():
            for (pc, rows), src in zip(targets, self.copies.upload(p, mine)):
                if rows is None:
                    if pc.name not in self.sharded:
                        write_fragment(self.params, [pc], [src], alpha, add)
                    continue  # (an empty value of a sharded piece under ``add``: left alone)
                lo = self.sharded[pc.name][0]
                local = self.params[pc.name].to_local()  # type: ignore[attr-defined]
                rows_here = dataclasses.replace(pc, row_start=rows[0] - lo, row_end=rows[1] - lo)
                write_fragment({pc.name: local}, [rows_here], [src.to(local.device)], alpha, add)

    def load_peer_state(self, state: PeerState) -> None:
        """Load a live peer's optimizer state (checked first: ``training.peer_state.load_state``)."""
        if self.optimizer is None:
            return
        problem = load_state(self.optimizer, state, self.device)
        if problem is not None:
            log.warning("learner %d: ignored optimizer state from learner %d: %s", self.learner, state.source, problem)
        else:
            self.on_handoff(state)

    def serve(self, learner: int) -> StateServer | None:
        """Its optimizer state for ``learner``, a piece per boundary as the session's budget
        says, each copy timed (the budget keeps it within a share of a step). Without an
        optimizer (or with sharded state, FSDP2) there is nothing to give; the peer does not
        wait for an answer."""
        if self.optimizer is None or self.sharded:
            return None
        return StateServer(self.optimizer, learner, self.learner, clock=time.perf_counter)
