"""Payload encodings of a tensor for the wire (pure: no I/O).

- ``fp32``: exact.
- ``bf16``: round-to-nearest-even to bfloat16; relative error <= 2^-8.
- ``int8``: blockwise symmetric absmax quantisation to [-127, 127] with one float32 scale per
  block of ``BLOCK_SIZE`` values; error <= absmax(block) / 127 / 2.
- ``int4``: the same with levels [-7, 7], two values packed per byte; error <= absmax / 7 / 2.

A block holding a non-finite value gets a non-finite scale, so it decodes to non-finite
values and the receiver's finiteness check still rejects it (never silently finite garbage).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ddiloco.errors import ConfigError

ENCODINGS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4")
"""Names accepted by ``encode`` and ``encoded_nbytes``."""

BLOCK_SIZE = 128
"""Values per quantisation block (one float32 scale each) for int8 and int4."""

_QMAX = {"int8": 127, "int4": 7}


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
    (int4, ``ceil(numel / 2)`` bytes, value ``2i`` in the low nibble, stored as ``q + 8``)."""
    scales: torch.Tensor | None = None
    """float32 scale per block of ``BLOCK_SIZE`` values (int8/int4), else None."""

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


def encoded_nbytes(numel: int, encoding: str) -> int:
    """Payload bytes of a tensor of ``numel`` values in ``encoding`` (for cost models)."""
    _check(encoding)
    if encoding == "fp32":
        return 4 * numel
    if encoding == "bf16":
        return 2 * numel
    scales = 4 * math.ceil(numel / BLOCK_SIZE)
    return scales + (numel if encoding == "int8" else math.ceil(numel / 2))


def _blocks(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` zero-padded to whole blocks, as [n_blocks, BLOCK_SIZE]."""
    pad = -flat.numel() % BLOCK_SIZE
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK_SIZE)


def encode(t: torch.Tensor, encoding: str) -> Encoded:
    """Encode ``t`` (any floating dtype, any shape) for the wire."""
    _check(encoding)
    flat = t.detach().reshape(-1).to(torch.float32)
    shape, dtype = tuple(t.shape), t.dtype
    if encoding == "fp32":
        return Encoded(encoding, shape, dtype, flat.clone())
    if encoding == "bf16":
        return Encoded(encoding, shape, dtype, flat.to(torch.bfloat16))

    qmax = _QMAX[encoding]
    blocks = _blocks(flat)
    scales = blocks.abs().amax(dim=1) / qmax  # nan/inf for a non-finite block, by design
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # all-zero block -> q = 0
    q = torch.nan_to_num(blocks / safe[:, None]).round().clamp(-qmax, qmax)
    q = q.reshape(-1)[: flat.numel()]
    if encoding == "int8":
        return Encoded(encoding, shape, dtype, q.to(torch.int8), scales)
    u = (q + 8).to(torch.uint8)  # [1, 15]; 0 pads an odd length
    if u.numel() % 2:
        u = torch.cat([u, u.new_zeros(1)])
    packed = u[0::2] | (u[1::2] << 4)
    return Encoded(encoding, shape, dtype, packed, scales)


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
        nibbles = torch.stack([e.data & 0x0F, e.data >> 4], dim=1).reshape(-1)[:n]
        q = nibbles.to(torch.float32) - 8
    values = _blocks(q) * e.scales[:, None]
    return values.reshape(-1)[:n].reshape(e.shape)
