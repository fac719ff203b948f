"""A workload's model for a role that will receive every value before it reads one.

A joining learner (``ddiloco learner``) takes every synced tensor of the global model, the
parameters and the persistent buffers, from the syncer before it trains: initialising its model
first is wasted work (seconds to minutes on CPU at 100M to 7B parameters). ``build_to_receive``
builds the model's structure on the meta device (``workloads.base.structure_only``) and gives
its tensors memory on the target device without writing them (as ``to_empty`` does). Where
the model does not allow that, it builds the model the ordinary way and says why: the model
does not build on the meta device, or it holds a tensor the join will not write (a
non-persistent buffer, a tensor kept as a plain attribute), which would stay unwritten memory.

The memory is not filled (zeros would cost a pass over the model and are no more the run's
values than what is there): the caller makes sure nothing reads a value before it is written.
``ddiloco learner`` does: ``Learner`` snapshots no fragment its join has not delivered, writes
the fragments a join that went quiet did not deliver from the ordinary build
(``Learner(initial=...)``) before anything reads them, and a DDP group's broadcasts before the
join (DDP's constructor) copy values without reading them; the join's own broadcast follows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from ddiloco.training.layout import synced_tensors
from ddiloco.workloads.base import Workload

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltModel:
    """A model and how it was built."""

    model: nn.Module
    empty: bool
    """Its tensors hold unwritten memory: every synced tensor must be written before any is read."""
    why: str = ""
    """Why it was built and initialised the ordinary way ("" when it is empty)."""

    @property
    def how(self) -> str:
        """ "empty" or "initialised" (the learner's start-up record says which)."""
        return "empty" if self.empty else "initialised"


def build_to_receive(workload: Workload, seed: int, device: torch.device | str) -> BuiltModel:
    """``workload``'s model on ``device`` with its tensors allocated and not initialised, for a
    caller that writes every synced tensor before it reads one; or, where that cannot be done
    safely, ``workload.build_model(seed)`` moved to ``device`` (``why`` says what stood in the way)."""
    device = torch.device(device)
    try:
        with torch.device("meta"):
            model = workload.build_model(seed)
        why = unwritten(model)
    except Exception as e:  # a workload's own code: any failure means "build it for real"
        why = f"it does not build on the meta device ({type(e).__name__}: {e})"
    if why is None:
        names = list(synced_tensors(model))
        _allocate(model, device)
        if list(synced_tensors(model)) != names:
            why = "its tensors are not the same after moving off the meta device"
    if why is not None:
        log.info("building the model and initialising it (its values all come from the join): %s", why)
        return BuiltModel(workload.build_model(seed).to(device), False, why)
    log.debug("built the model without initialising it: the join writes every value")
    return BuiltModel(model, True)


def unwritten(model: nn.Module) -> str | None:
    """What in a model built on the meta device a join would leave unwritten (None: nothing):
    a tensor that is not on the meta device (the workload built it with values), a buffer that
    is not persistent, or a tensor kept as a plain attribute (``to_empty`` leaves it on meta)."""
    synced = {id(t) for t in synced_tensors(model).values()}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not t.is_meta:
            return f"{name} was built on {t.device}, not on the meta device"
        if id(t) not in synced:
            return f"buffer {name} is not persistent: the join does not write it"
    for prefix, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                return f"{prefix or 'the model'}.{attr} is a tensor outside its parameters and buffers"
    return None


def _allocate(model: nn.Module, device: torch.device) -> None:
    """Every parameter and buffer of ``model`` (built on the meta device) given memory on
    ``device``, unwritten: ``model.to_empty(device=device)``, without its one-off half second of
    imports (its ``empty_like`` of a meta tensor runs a Python reference), and keeping tied
    tensors tied (``to_empty`` makes a new tensor for each module that holds one)."""
    new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (old, new): the old ones stay alive
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in new:
                    e = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
                    new[id(t)] = (t, nn.Parameter(e, t.requires_grad) if isinstance(t, nn.Parameter) else e)
                table[name] = new[id(t)][1]  # type: ignore[assignment]
