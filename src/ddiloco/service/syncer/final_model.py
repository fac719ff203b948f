"""The final model file: its entries from the core's pieces (``file_entries``, ``state_keys``),
and its BatchNorm statistics re-estimated on its own weights (``SyncerServer(calibrate=)``).

The merged statistics are the learners' own, each measured on that learner's weights before the
last merge; the final outer step moves the weights past every learner's, and the statistics no
longer fit them (``bench/resnet_port.py``: a held-out loss of 3.9 with them, 0.43 re-estimated).
At the run's end the syncer can measure them afresh: a copy of the final global model is given
to the user's ``calibrate(model)``, which runs training data through it
(``ddiloco.recalibrate_batch_norm``), and its floating buffers become the final model's (file,
final evaluations, the model given back). Counts (``num_batches_tracked``) keep their merged
value: they say how much the run measured, not how much the calibration did.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ddiloco.core.fragments import FragmentLayout, Piece
from ddiloco.training.empty_model import let_go, receiving_copy
from ddiloco.training.layout import synced_tensors

log = logging.getLogger(__name__)

Calibrate = Callable[[nn.Module], Any]
Entry = tuple[str, torch.dtype, tuple[int, ...], list[torch.Tensor]]


def state_keys(model: nn.Module) -> dict[str, tuple[str, torch.dtype]]:
    """Each key of ``model.state_dict()`` with the synced tensor that holds its values (a tied
    key names the tensor it shares) and its dtype."""
    synced = synced_tensors(model)
    by_id = {id(t): n for n, t in synced.items()}
    by_storage = {(t.data_ptr(), tuple(t.shape)): n for n, t in synced.items() if t.numel() and not t.is_meta}
    out = {}
    for key, t in model.state_dict(keep_vars=True).items():
        # the same tensor object, or (a tied buffer listed under another name) the same storage
        name = by_id.get(id(t)) or by_storage.get((t.data_ptr(), tuple(t.shape)), key)
        out[key] = (name, t.dtype)
    return out


def file_entries(
    pieces: dict[str, list[tuple[Piece, torch.Tensor]]],
    keys: Mapping[str, tuple[str, torch.dtype]],
    statistics: Mapping[str, torch.Tensor],
) -> tuple[list[Entry], dict[str, str]]:
    """The final model file's entries (key, dtype, shape, its row pieces' values) and aliases.

    Every key of the model's state dict, in its dtype, from the core's pieces (no copy of the
    model); a tied key (an LM head sharing the embedding) is written once, under its first key,
    and its other keys as aliases of that one (load_state_dict lists them again). ``statistics``
    replace the merged values of those buffers (a buffer is one piece: never split by rows)."""
    pieces = {**pieces, **{name: [(pieces[name][0][0], value)] for name, value in statistics.items()}}
    entries: list[Entry] = []
    aliases: dict[str, str] = {}
    stored: dict[tuple[str, torch.dtype], str] = {}  # (synced tensor, dtype) -> the key it is written under
    for key, (name, dtype) in keys.items():
        if (name, dtype) in stored:
            aliases[key] = stored[name, dtype]
        elif name in pieces:
            stored[name, dtype] = key
            rows = pieces[name]
            first = rows[0][0]
            total_rows = sum(pc.row_end - pc.row_start for pc, _ in rows)
            shape = tuple(first.shape) if len(rows) == 1 else (total_rows, *first.shape[1:])
            entries.append((key, dtype, shape, [v for _, v in rows]))
    return entries, aliases


def statistics_shapes(layout: FragmentLayout) -> dict[str, tuple[int, ...]]:
    """The layout's floating buffers (BatchNorm's running mean and variance), by name: what a
    calibration may replace."""
    return {pc.name: tuple(pc.shape) for frag in layout.fragments for pc in frag if pc.kind == "buffer"}


def checked_statistics(
    given: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """``given``'s floating buffers as fp32 CPU copies, or ``ValueError`` saying the first that
    cannot be the final model's: another shape, a value that is not finite, a negative variance."""
    out = {}
    for name, shape in shapes.items():
        value = given[name].detach().to("cpu", torch.float32)
        if tuple(value.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, the model's is {shape}")
        if not torch.isfinite(value).all():
            raise ValueError(f"{name} is not finite")
        if name.endswith("running_var") and bool((value < 0).any()):
            raise ValueError(f"{name} has a negative variance")
        out[name] = value.clone()
    return out


def recalibrated(
    structure: nn.Module,
    load_into: Callable[[nn.Module], None],
    calibrate: Calibrate,
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, torch.Tensor] | None:
    """Run ``calibrate`` on a CPU copy of the final global model (``structure``'s, given every
    value by ``load_into``) and return its floating buffers, checked; None (with one WARNING
    line) when the user's function raised or gave statistics the model cannot take."""
    if not shapes:
        log.info("calibrate=: the model has no floating buffers (no BatchNorm): the final model is as merged")
        return None
    model = receiving_copy(structure)
    try:
        load_into(model)
        model.train()
        calibrate(model)
        return checked_statistics(synced_tensors(model), shapes)
    except Exception as e:  # the user's code, or what it left: one line, the merged statistics stay
        log.warning(
            "calibrate= failed (%s: %s); the final model keeps the merged statistics: check the function on a copy "
            "of the model (ddiloco.recalibrate_batch_norm(model, batches))",
            type(e).__name__,
            e,
        )
        return None
    finally:
        let_go(model)
