"""The tensors of a learner's saved state, read from their safetensors files one at a time.

A restart takes back about five times the model (the model, the optimizer's two moments, the
base copies and the residuals). Read at once, each file also mapped while it is copied, that
was 7.6 N above the process's idle size at 30M before training began (``metrics/startup.jsonl``'s
``peak_mib`` at ``restore``), and the freed copies stayed in the heap under the first steps.
Here only each file's header is read up front (names, shapes, dtypes: enough to check that a
save fits); a tensor's bytes are read when it is taken, its file mapped only for that read.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
"""safetensors' dtype names of what a save holds (another is refused as damaged)."""


class SavedTensors(Mapping[str, torch.Tensor]):
    """Name -> tensor over a save's files, read lazily: ``spec`` from the headers, a value when
    it is looked up; ``pop`` reads it and forgets it (each tensor is held once, by its taker)."""

    def __init__(self, files: list[Path]) -> None:
        """Read each file's header. Raises (safetensors' own error, OSError or ValueError) for an
        unreadable file, a dtype a save does not write, or a name in two files."""
        from safetensors import safe_open

        self._where: dict[str, tuple[Path, tuple[int, ...], torch.dtype]] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():  # noqa: SIM118  (a safetensors handle, not a dict)
                    part = h.get_slice(name)
                    dtype = _DTYPES.get(part.get_dtype())
                    if dtype is None or name in self._where:
                        raise ValueError(f"{name[:80]!r}: {'another dtype' if dtype is None else 'in two files'}")
                    self._where[name] = (f, tuple(part.get_shape()), dtype)

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Its shape and dtype, from its file's header."""
        _, shape, dtype = self._where[name]
        return shape, dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self._where[name][0]
        with safe_open(str(path), framework="pt") as h:  # mapped for this read only
            t: torch.Tensor = h.get_tensor(name)
        return t

    def pop(self, name: str) -> torch.Tensor:
        t = self[name]
        del self._where[name]
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._where))

    def __len__(self) -> int:
        return len(self._where)


Tensors = dict[str, torch.Tensor] | SavedTensors
"""Tensors a save's reader hands over: read already (a dict) or as they are taken."""


def spec_of(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[tuple[int, ...], torch.dtype]:
    """A tensor's shape and dtype, from the header where it is not read yet."""
    if isinstance(tensors, SavedTensors):
        return tensors.spec(name)
    t = tensors[name]
    return tuple(t.shape), t.dtype
