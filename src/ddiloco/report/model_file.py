"""The global model as a file: a plain state dict in safetensors, and where a run folder keeps
it (``final/model.safetensors``). Written by the syncer when it stops, read by ``ddiloco export``
and by users (``ddiloco.load_state_dict``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from ddiloco.errors import DDiLoCoError

FINAL = Path("final") / "model.safetensors"
"""Where a run folder holds the syncer's final global model."""


def save_state_dict(state: Mapping[str, torch.Tensor], path: str | Path) -> Path:
    """Write ``state`` as safetensors. Tensors that share memory (tied weights) are written as
    copies, so a plain ``model.load_state_dict(load_state_dict(path))`` restores every key."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        # safetensors refuses tensors that share memory: the second of a tied pair is a copy
        out[name] = t.clone() if ptr and ptr in seen else t
        seen.add(ptr)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(out, str(tmp))
    tmp.replace(path)  # a reader never sees half a file
    return path


def load_state_dict(source: str | Path) -> dict[str, torch.Tensor]:
    """The state dict in a safetensors file, or in a run folder's ``final/model.safetensors``."""
    from safetensors.torch import load_file

    path = Path(source)
    if path.is_dir():
        path = path / FINAL
    if not path.is_file():
        raise DDiLoCoError(
            f"{path} does not exist: pass a run folder whose syncer has stopped (it writes {FINAL}) or a "
            ".safetensors file"
        )
    return load_file(str(path))
