"""The global model as a file: a plain state dict in safetensors, and where a run folder keeps
it (``final/model.safetensors``). Written by the syncer when it stops, read by ``ddiloco export``
and by users (``ddiloco.load_state_dict``)."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

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


_ST_DTYPE = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip
"""safetensors' names of the dtypes a state dict holds."""


def save_pieces(entries: Sequence[tuple[str, torch.dtype, Sequence[int], Sequence[torch.Tensor]]], path: Path) -> Path:
    """Write a safetensors file tensor by tensor from its pieces: ``(key, dtype, shape, pieces)``,
    the pieces (fp32 rows, in order) joined make the tensor. Nothing is assembled in memory: a
    piece at a time is converted to ``dtype`` (integers rounded) and written, so the syncer's
    final model costs no copy of the model (``save_state_dict`` builds the whole file's bytes)."""
    header: dict[str, Any] = {}
    at = 0
    for key, dtype, shape, _ in entries:
        if dtype not in _ST_DTYPE:
            raise DDiLoCoError(f"cannot write {key} of dtype {dtype} to safetensors")
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _key, dtype, _, pieces in entries:
            for v in pieces:
                t = (v if dtype.is_floating_point else v.round()).to(dtype).contiguous()
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # little-endian hosts
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
