"""The global model as a file: a plain state dict in safetensors, and where a run folder keeps
it (``final/model.safetensors``). Written by the syncer when it stops, read by ``ddiloco export``
and by users (``ddiloco.load_state_dict``).

Tied weights (an LM head sharing the embedding: one tensor under several state-dict names) are
written once, under the first name; the file's ``__metadata__`` then holds ``ALIASES``, a JSON
object {other name: stored name}, and ``load_state_dict`` lists every name again (the same
tensor), so ``model.load_state_dict(load_state_dict(path))`` stays strict. This is how
``safetensors.torch.save_model`` and Hugging Face's ``save_pretrained`` keep shared tensors:
once, with their other names beside them. A file with no such entry (older ddiloco files held
tied weights as copies) reads as it always did.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ddiloco.errors import DDiLoCoError

FINAL = Path("final") / "model.safetensors"
"""Where a run folder holds the syncer's final global model."""

ALIASES = "ddiloco.aliases"
"""The ``__metadata__`` entry naming the keys a file holds once: JSON, {alias: stored key}."""

MAX_ALIASES_CHARS = 1 << 22
"""The longest alias map ``load_state_dict`` reads (4 Mi characters: tens of thousands of tied
names, far more than any model has); the metadata is untrusted input from disk."""


def view_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors one tied weight: the same memory seen the same way (storage,
    offset, shape, strides, dtype). None for an empty or meta tensor (nothing to share)."""
    if t.numel() == 0 or t.is_meta:
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def save_state_dict(state: Mapping[str, torch.Tensor], path: str | Path) -> Path:
    """Write ``state`` as safetensors. A tensor listed under several names (tied weights) is
    written once and its other names as aliases in the metadata, so a plain
    ``model.load_state_dict(load_state_dict(path))`` restores every key; tensors that merely
    overlap in memory are written as copies."""
    from safetensors.torch import save_file

    first: dict[tuple[Any, ...], str] = {}  # a tied tensor's view -> the name it is stored under
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in state.items():
        t = t.detach()
        view = view_key(t)  # on the tensor as given: moved to the CPU, tied GPU tensors become two
        if view is not None and view in first:
            aliases[name] = first[view]
            continue
        if view is not None:
            first[view] = name
        t = t.to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        # safetensors refuses tensors that share memory: one overlapping another is a copy
        out[name] = t.clone() if ptr and ptr in seen else t
        seen.add(ptr)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(out, str(tmp), metadata=_metadata(aliases, out.keys()))
    try:
        tmp.chmod(0o666 & ~_umask())  # safetensors makes its files 0600: a model file is readable as any other
    except OSError:  # a file system that refuses modes: the file is written all the same
        pass
    tmp.replace(path)  # a reader never sees half a file
    return path


def _metadata(aliases: Mapping[str, str], stored: Collection[str]) -> dict[str, str] | None:
    """The file's ``__metadata__`` for ``aliases`` (None: none, the header as before)."""
    if not aliases:
        return None
    for alias, target in aliases.items():
        if target not in stored or alias in stored:
            raise DDiLoCoError(f"cannot write {alias} as an alias of {target}: {target} must be a stored tensor")
    # "format": Hugging Face's loaders refuse a safetensors file with metadata but no format
    return {"format": "pt", ALIASES: json.dumps(dict(aliases), separators=(",", ":"))}


_ST_DTYPE = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip
"""safetensors' names of the dtypes a state dict holds."""


def _umask() -> int:
    """The process's umask, read without changing it where /proc says it (Linux); elsewhere set and
    set back at once (never looser than the user's)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def save_pieces(
    entries: Sequence[tuple[str, torch.dtype, Sequence[int], Sequence[torch.Tensor]]],
    path: Path,
    aliases: Mapping[str, str] | None = None,
) -> Path:
    """Write a safetensors file tensor by tensor from its pieces: ``(key, dtype, shape, pieces)``,
    the pieces (fp32 rows, in order) joined make the tensor. Nothing is assembled in memory: a
    piece at a time is converted to ``dtype`` (integers rounded) and written, so the syncer's
    final model costs no copy of the model (``save_state_dict`` builds the whole file's bytes).
    ``aliases``: {key: key of an entry} for tied keys, written once (see ``ALIASES``)."""
    header: dict[str, Any] = {}
    meta = _metadata(aliases or {}, {key for key, *_ in entries})
    if meta is not None:
        header["__metadata__"] = meta  # first, where safetensors writes it
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
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)  # its bytes, no copy (little-endian hosts)
    tmp.replace(path)  # a reader never sees half a file
    return path


def load_state_dict(source: str | Path) -> dict[str, torch.Tensor]:
    """The state dict in a safetensors file, or in a run folder's ``final/model.safetensors``:
    every key, a tied one (stored once) as the same tensor as the key it shares."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    path = Path(source)
    if path.is_dir():
        path = path / FINAL
    if not path.is_file():
        raise DDiLoCoError(
            f"{path} does not exist: pass a run folder whose syncer has stopped (it writes {FINAL}) or a "
            ".safetensors file"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        state = load_file(str(path))  # as before aliases: every stored tensor, in load_file's order
    except SafetensorError as e:
        raise DDiLoCoError(f"{path} is not a readable safetensors file ({e})") from None
    for alias, target in _aliases(meta, state.keys(), path).items():
        state[alias] = state[target]
    return state


def _aliases(meta: Mapping[str, str] | None, stored: Collection[str], path: Path) -> dict[str, str]:
    """The file's alias map, checked: {alias: stored key}, each alias a new name and each target
    a tensor the file holds (so no chain, no cycle, no alias shadowing a tensor). Anything else
    is one DDiLoCoError line: a wrong map would load a silently wrong model."""
    raw = (meta or {}).get(ALIASES)
    if raw is None:
        return {}  # no tied keys, or a file written before aliases (tied weights as copies)

    def bad(why: str) -> DDiLoCoError:
        return DDiLoCoError(
            f"{path}: its tied-weights map (__metadata__ {ALIASES!r}) {why}; the file is damaged or was not "
            "written by ddiloco"
        )

    if not isinstance(raw, str) or len(raw) > MAX_ALIASES_CHARS:
        raise bad(f"is over {MAX_ALIASES_CHARS} characters" if isinstance(raw, str) else "is not text")
    try:
        got = json.loads(raw, object_pairs_hook=_unique_pairs)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deep enough to exhaust the stack
        raise bad(f"is not a JSON object ({str(e)[:80]})") from None
    if not isinstance(got, dict):
        raise bad(f"is a JSON {type(got).__name__}, not an object")
    for alias, target in got.items():
        if not isinstance(target, str):
            raise bad(f"maps {alias[:80]!r} to a {type(target).__name__}, not a tensor name")
        if not alias or alias in stored:
            raise bad(f"names {alias[:80]!r} as an alias, but it is {'a tensor' if alias else 'empty'}")
        if target not in stored:
            raise bad(f"maps {alias[:80]!r} to {target[:80]!r}, which the file does not hold")
    return got


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose names are unique (one alias listed twice is ambiguous, not "the last")."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a name is listed twice")
    return out
