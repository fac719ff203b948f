"""Payload encodings of a tensor for the wire (pure: no I/O).

- ``fp32``: exact.
- ``bf16``: round-to-nearest-even to bfloat16; relative error <= 2^-8.
- ``int8``: blockwise symmetric absmax quantisation to [-127, 127] with one float32 scale per
  block of ``BLOCK_SIZE`` values; error <= absmax(block) / 127 / 2.
- ``int4``: the same with levels [-7, 7], two values packed per byte; error <= absmax / 7 / 2.
- ``int2``: the same with levels [-1, 0, 1] (ternary), four values packed per byte; error <=
  absmax / 2. For the ablation: the paper's pattern is 4-bit near-lossless, 2-bit clearly worse.

A block holding a non-finite value gets a non-finite scale, so it decodes to non-finite
values and the receiver's finiteness check still rejects it (never silently finite garbage).
``check`` is what a receiver runs on an encoded payload from the network before decoding it:
sizes that match the shape, finite and bounded scales, codes in range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from ddiloco.errors import ConfigError

Encoding = Literal["fp32", "bf16", "int8", "int4", "int2"]
ENCODINGS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4", "int2")
"""Names accepted by ``encode`` and ``encoded_nbytes``."""

BLOCK_SIZE = 128
"""Values per quantisation block (one float32 scale each) for the int encodings."""

MAX_SCALE = 2.0**64
"""Largest block scale a receiver accepts (a delta that large is garbage; screening bounds the rest)."""

_QMAX = {"int8": 127, "int4": 7, "int2": 1}
_PER_BYTE = {"int4": 2, "int2": 4}  # packed codes per byte, stored as q + offset
_OFFSET = {"int4": 8, "int2": 1}
_BITS = {"int4": 4, "int2": 2}
DATA_DTYPE = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
    "int4": torch.uint8,
    "int2": torch.uint8,
}
"""The dtype of ``Encoded.data`` for each encoding."""


@dataclass(frozen=True)
class Encoded:
    """One tensor as sent on the wire."""

    encoding: str
    """One of ``ENCODINGS``."""
    shape: tuple[int, ...]
    """Shape of the original tensor."""
    dtype: torch.dtype
    """dtype of the original tensor (``decode`` always returns float32)."""
    data: torch.Tensor
    """Flat payload: float32 (fp32), bfloat16 (bf16), int8 (int8, ``numel`` values) or uint8
    (int4: ``ceil(numel / 2)`` bytes, value ``2i`` in the low nibble, stored as ``q + 8``; int2:
    ``ceil(numel / 4)`` bytes, value ``4i`` in the lowest two bits, stored as ``q + 1``)."""
    scales: torch.Tensor | None = None
    """float32 scale per block of ``BLOCK_SIZE`` values (int encodings), else None."""

    @property
    def numel(self) -> int:
        """Number of values in the original tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of payload on the wire (data plus scales; the small header is not counted)."""
        n = self.data.numel() * self.data.element_size()
        if self.scales is not None:
            n += self.scales.numel() * self.scales.element_size()
        return n


def _check(encoding: str) -> None:
    if encoding not in ENCODINGS:
        raise ConfigError(f"unknown encoding {encoding!r}; allowed: {', '.join(ENCODINGS)}")


def is_lossy(encoding: str) -> bool:
    """Whether ``encoding`` loses information (every encoding but fp32)."""
    return encoding != "fp32"


def data_nbytes(numel: int, encoding: str) -> int:
    """Bytes of an encoding's data frame for ``numel`` values (scales not included)."""
    _check(encoding)
    if encoding == "fp32":
        return 4 * numel
    if encoding == "bf16":
        return 2 * numel
    return math.ceil(numel / _PER_BYTE.get(encoding, 1))


def num_blocks(numel: int) -> int:
    """Scales an int encoding carries for ``numel`` values."""
    return math.ceil(numel / BLOCK_SIZE)


def encoded_nbytes(numel: int, encoding: str) -> int:
    """Payload bytes of a tensor of ``numel`` values in ``encoding`` (for cost models)."""
    scales = 4 * num_blocks(numel) if encoding in _QMAX else 0
    return data_nbytes(numel, encoding) + scales


def _blocks(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` zero-padded to whole blocks, as [n_blocks, BLOCK_SIZE]."""
    pad = -flat.numel() % BLOCK_SIZE
    return (flat if pad == 0 else torch.nn.functional.pad(flat, (0, pad))).view(-1, BLOCK_SIZE)


def encode(t: torch.Tensor, encoding: str) -> Encoded:
    """Encode ``t`` (any floating dtype, any shape) for the wire."""
    _check(encoding)
    flat = t.detach().reshape(-1).to(torch.float32)
    shape, dtype = tuple(t.shape), t.dtype
    if encoding == "fp32":
        return Encoded(encoding, shape, dtype, flat.clone() if flat.data_ptr() == t.data_ptr() else flat)
    if encoding == "bf16":
        return Encoded(encoding, shape, dtype, flat.to(torch.bfloat16))

    qmax = _QMAX[encoding]
    blocks = _blocks(flat)
    scales = blocks.abs().amax(dim=1).div_(qmax)  # nan/inf for a non-finite block, by design
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # all-zero block -> q = 0
    # One new tensor, then in place: each pass over a fragment costs as much as the arithmetic.
    q = torch.div(blocks, safe[:, None]).nan_to_num_().round_().clamp_(-qmax, qmax)
    q = q.view(-1)[: flat.numel()]
    if encoding == "int8":
        return Encoded(encoding, shape, dtype, q.to(torch.int8), scales)
    per, bits = _PER_BYTE[encoding], _BITS[encoding]
    u = q.add_(_OFFSET[encoding]).to(torch.uint8)
    pad = -u.numel() % per  # pad codes are 0 (outside the stored range of int4; checked for int2)
    if pad:
        u = torch.cat([u, u.new_zeros(pad)])
    u = u.view(-1, per)
    packed = u[:, 0].clone()
    for k in range(1, per):
        packed |= u[:, k] << (bits * k)
    return Encoded(encoding, shape, dtype, packed, scales)


def _unpack(e: Encoded) -> torch.Tensor:
    """The stored (offset) codes of a packed encoding, padding included, as uint8."""
    per, bits = _PER_BYTE[e.encoding], _BITS[e.encoding]
    mask = (1 << bits) - 1
    out = torch.empty(e.data.numel(), per, dtype=torch.uint8)
    for k in range(per):  # written in place: no shifted temporaries, no stack
        torch.bitwise_and(e.data if k == 0 else torch.bitwise_right_shift(e.data, bits * k), mask, out=out[:, k])
    return out.view(-1)


def decode(e: Encoded) -> torch.Tensor:
    """The float32 tensor that ``e`` encodes."""
    _check(e.encoding)
    if e.encoding in ("fp32", "bf16"):
        return e.data.to(torch.float32).reshape(e.shape)
    assert e.scales is not None, "int encodings carry scales"
    n = e.numel
    if e.encoding == "int8":
        q = e.data.to(torch.float32)
    else:
        q = _unpack(e)[:n].to(torch.float32).sub_(_OFFSET[e.encoding])
    # scaled in place, whole blocks as a [blocks, BLOCK_SIZE] view and the last one apart: no padding copy
    full = n // BLOCK_SIZE * BLOCK_SIZE
    q[:full].view(-1, BLOCK_SIZE).mul_(e.scales[: full // BLOCK_SIZE, None])
    if full < n:
        q[full:].mul_(e.scales[-1])
    return q.view(e.shape)


def check(e: Encoded) -> str | None:
    """Why ``e`` (from the network) is not a well-formed encoding, or None: the data and the
    scales must have the sizes its shape needs, the scales must be finite, >= 0 and at most
    ``MAX_SCALE``, and every code must be in its encoding's range (padding included)."""
    if e.encoding not in ENCODINGS:
        return f"unknown encoding {e.encoding!r}"
    n = e.numel
    if e.data.dtype != DATA_DTYPE[e.encoding] or e.data.dim() != 1:
        return f"{e.encoding} data must be a flat {DATA_DTYPE[e.encoding]} tensor"
    if e.data.numel() * e.data.element_size() != data_nbytes(n, e.encoding):
        expected = data_nbytes(n, e.encoding)
        return f"{e.encoding} data of {e.data.numel()} elements for {n} values (expected {expected} bytes)"
    if e.encoding not in _QMAX:
        return None if e.scales is None else f"{e.encoding} carries no scales"
    if e.scales is None or e.scales.dtype != torch.float32 or e.scales.dim() != 1:
        return f"{e.encoding} needs a flat float32 tensor of scales"
    if e.scales.numel() != num_blocks(n):
        return f"{e.scales.numel()} scales for {n} values (expected {num_blocks(n)} blocks of {BLOCK_SIZE})"
    if not bool(torch.isfinite(e.scales).all()):
        return "a scale is not finite"
    if bool((e.scales < 0).any()) or bool((e.scales > MAX_SCALE).any()):
        return f"a scale is outside [0, {MAX_SCALE:.3g}]"
    if e.encoding == "int8":
        if n and int(e.data.min()) < -127:
            return "an int8 code is -128 (the range is [-127, 127])"
        return None
    codes = _unpack(e)
    low, high = (1, 15) if e.encoding == "int4" else (0, 2)
    body, pad = codes[:n], codes[n:]
    if body.numel() and (int(body.min()) < low or int(body.max()) > high):
        return f"an {e.encoding} code is outside its range"
    if pad.numel() and int(pad.max()) != 0:
        return f"the {e.encoding} padding is not zero"
    return None
