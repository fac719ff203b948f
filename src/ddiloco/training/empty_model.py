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

The same holds for a model that is already built (``SyncerServer``'s, given in code):
``receiving_copy`` copies its structure with memory for its synced tensors and no values (the
evaluate hook's copy, which the global model fills), and ``let_go`` / ``take_back`` move a model's
synced tensors to the meta device in place while another holder keeps their values, and give
them values again (the holder's own tensors where they fit as they are, else written copies).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ddiloco.core.fragments import Piece, storage_bytes, write_fragment
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
                if t is None or not t.is_meta:
                    continue  # (a tensor with values: a copied non-persistent buffer keeps them)
                if id(t) not in new:
                    e = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
                    new[id(t)] = (t, nn.Parameter(e, t.requires_grad) if isinstance(t, nn.Parameter) else e)
                table[name] = new[id(t)][1]  # type: ignore[assignment]


def _synced_unique(model: nn.Module) -> dict[int, torch.Tensor]:
    """Each synced tensor of ``model`` once (by identity), ties included once."""
    return {id(t): t for t in synced_tensors(model).values()}


def receiving_copy(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """A copy of ``model`` whose synced tensors (the parameters and persistent buffers) have
    memory on ``device`` and no values (unwritten: the caller writes every one before reading
    any), and whose other state (non-persistent buffers, attributes) is copied as it is; tied
    tensors stay tied. ``model``'s synced values are never read or copied: it may hold them, or
    be on the meta device (``let_go``)."""
    memo: dict[int, object] = {}
    for key, t in _synced_unique(model).items():
        shell = torch.empty_like(t, device="meta")
        memo[key] = nn.Parameter(shell, t.requires_grad) if isinstance(t, nn.Parameter) else shell
    clone = copy.deepcopy(model, memo)
    _allocate(clone, torch.device(device))
    return clone


@dataclass(frozen=True)
class LetGo:
    """A model whose synced tensors ``let_go`` moved to the meta device: where each one was."""

    model: nn.Module
    devices: dict[str, torch.device]
    """Each synced tensor's device before (by name)."""


def let_go(model: nn.Module) -> LetGo:
    """Move ``model``'s synced tensors to the meta device in place: the same tensor objects
    (``torch.utils.swap_tensors``; where a tensor cannot be swapped, the module's entry is
    replaced), tied ones still tied, shapes and dtypes kept, no memory. Its other state (a
    non-persistent buffer, an attribute) is left as it is. Whoever else holds the values (a
    view of them) keeps them; the model no longer does."""
    devices = {name: t.device for name, t in synced_tensors(model).items()}
    _replace(model, lambda t: torch.empty_like(t, device="meta"))
    return LetGo(model, devices)


def take_back(held: LetGo, pieces: Mapping[str, Sequence[tuple[Piece, torch.Tensor]]]) -> nn.Module:
    """Give the synced tensors of a model ``let_go`` emptied their values again, in place:
    ``pieces`` holds every synced tensor's pieces with their values (``fragments.tensor_pieces``).
    A tensor whose one piece is all of it, in its dtype, shape and device, becomes that value
    (shared, not copied: its holder lets it go); any other gets memory on its device and its
    pieces are written into it."""
    model = held.model
    where = {id(t): held.devices[name] for name, t in synced_tensors(model).items()}
    found = {id(t): _whole(t, pieces[name], where[id(t)]) for name, t in synced_tensors(model).items()}
    whole = {k: v for k, v in found.items() if v is not None}

    def make(t: torch.Tensor) -> torch.Tensor:
        v = whole.get(id(t))
        if v is not None:
            return v.detach()
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=where[id(t)])

    _replace(model, make)
    with torch.no_grad():
        for name, t in synced_tensors(model).items():
            if id(t) not in whole:  # (ids are those of the same objects: _replace swaps in place)
                write_fragment({name: t}, [pc for pc, _ in pieces[name]], [v for _, v in pieces[name]])
    return model


def _whole(t: torch.Tensor, pieces: Sequence[tuple[Piece, torch.Tensor]], device: torch.device) -> torch.Tensor | None:
    """The value that is all of ``t`` as it is (one piece, the same dtype, shape and device), else None."""
    if len(pieces) != 1:
        return None
    v = pieces[0][1]
    return v if v.dtype == t.dtype and v.shape == t.shape and v.device == device else None


def synced_bytes(model: nn.Module) -> int:
    """The memory ``model``'s synced tensors hold (each storage once; on the meta device: none)."""
    return storage_bytes([t for t in synced_tensors(model).values() if not t.is_meta])


def _replace(model: nn.Module, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Each synced tensor of ``model`` replaced in place by ``make(t)`` (its requires_grad kept)."""
    from torch.utils import swap_tensors

    for t in list(_synced_unique(model).values()):
        new = make(t)
        new = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
        try:
            with torch.no_grad():  # the object stays: references to it (a tie, an optimizer) see the change
                swap_tensors(t, new)  # type: ignore[no-untyped-call]
        except RuntimeError:  # (another reference to its tensor, an autograd graph: replace the entries)
            for module in model.modules():
                for table in (module._parameters, module._buffers):
                    for name, entry in table.items():
                        if entry is t:
                            table[name] = new  # type: ignore[assignment]
