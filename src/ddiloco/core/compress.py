"""Payload encodings of a tensor for the wire (pure: no I/O).

- ``fp32``: exact.
- ``bf16``: round-to-nearest-even to bfloat16; relative error <= 2^-8.
- ``int8``: blockwise symmetric absmax quantisation to [-127, 127] with one float32 scale per
  block of ``BLOCK_SIZE`` values; error <= absmax(block) / 127 / 2.
- ``int4``: the same with levels [-7, 7], two values packed per byte; error <= absmax / 7 / 2.
- ``int2``: the same with levels [-1, 0, 1] (ternary), four values packed per byte; error <=
  absmax / 2. For the ablation: the paper's pattern is 4-bit near-lossless, 2-bit clearly worse.
- ``<value>+top<k>`` (``int2+top41``): sparse. Of every chunk of ``CHUNK`` values only the ``k``
  largest in magnitude go (of a shorter last chunk its share of k, at least one), in the
  ``<value>`` encoding above (its blocks over the kept values), each with its 12-bit position in
  its chunk (two positions per three bytes, in increasing
  order). What is dropped is error feedback's to carry (SparseLoCo's top-k + 2-bit recipe).

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
"""The value encodings: names accepted by ``encode`` and ``encoded_nbytes``, alone or as the
``<value>`` of a sparse ``<value>+top<k>``."""

CHUNK = 4096
"""Values per top-k chunk of a sparse encoding (a position in it fits 12 bits)."""

_TOP = "+top"

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
    indices: torch.Tensor | None = None
    """Sparse encodings: the kept values' positions in their chunks, 12 bits each packed two per
    three bytes (uint8, ``index_nbytes`` of them); ``data`` and ``scales`` then encode only the
    kept values. None for a dense encoding."""

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
        if self.indices is not None:
            n += self.indices.numel()
        return n


def parse(encoding: str) -> tuple[str, int] | None:
    """``encoding`` as (its value encoding, values kept per chunk: 0 for dense), or None when it
    names no encoding (a sparse one needs 1 <= k < CHUNK, written without leading zeros)."""
    if encoding in ENCODINGS:
        return encoding, 0
    value, sep, k = encoding.partition(_TOP) if isinstance(encoding, str) else ("", "", "")
    digits = sep and len(k) <= 4 and k.isascii() and k.isdigit()  # short: int() of 5,000 digits raises
    if digits and value in ENCODINGS and k == str(int(k)) and 1 <= int(k) < CHUNK:
        return value, int(k)
    return None


def sparse(value: str, density: float) -> str:
    """The encoding that sends ``density`` of the values (rounded to a whole number per chunk, at
    least one) in ``value``; ``value`` itself at density 1."""
    _check(value)
    k = max(1, round(density * CHUNK))
    return value if k >= CHUNK else f"{value}{_TOP}{k}"


def density(encoding: str) -> float:
    """The share of values ``encoding`` sends (1 for a dense one)."""
    _, k = _parsed(encoding)
    return k / CHUNK if k else 1.0


def _parsed(encoding: str) -> tuple[str, int]:
    parsed = parse(encoding)
    if parsed is None:
        raise ConfigError(
            f"unknown encoding {encoding!r}; allowed: {', '.join(ENCODINGS)}, or one of them "
            f"+top<k> (1 <= k < {CHUNK}: sparse)"
        )
    return parsed


def _check(encoding: str) -> None:
    _parsed(encoding)


def is_lossy(encoding: str) -> bool:
    """Whether ``encoding`` loses information (every encoding but fp32)."""
    return encoding != "fp32"


def kept(numel: int, encoding: str) -> int:
    """How many of ``numel`` values ``encoding`` sends (all of them when dense)."""
    _, k = _parsed(encoding)
    if not k:
        return numel
    return numel // CHUNK * k + _tail_kept(numel % CHUNK, k)


def _tail_kept(length: int, k: int) -> int:
    """Values kept of a last chunk of ``length`` < CHUNK values: its share of k, at least one (so
    a small tensor, a bias or a norm's scale, is as sparse as the rest, not sent whole)."""
    return min(length, max(1, round(k * length / CHUNK))) if length else 0


def index_nbytes(count: int) -> int:
    """Bytes of ``count`` packed 12-bit positions (two per three bytes)."""
    return 3 * ((count + 1) // 2)


def data_nbytes(numel: int, encoding: str) -> int:
    """Bytes of an encoding's data for ``numel`` values (scales and positions not included)."""
    value, k = _parsed(encoding)
    n = kept(numel, encoding) if k else numel
    if value == "fp32":
        return 4 * n
    if value == "bf16":
        return 2 * n
    return math.ceil(n / _PER_BYTE.get(value, 1))


def num_blocks(numel: int) -> int:
    """Scales an int encoding carries for ``numel`` (encoded) values."""
    return math.ceil(numel / BLOCK_SIZE)


def frame_nbytes(numel: int, encoding: str) -> tuple[int, int, int]:
    """The payload of ``numel`` values in ``encoding`` as (scales, data, positions) bytes."""
    value, k = _parsed(encoding)
    n = kept(numel, encoding)
    scales = 4 * num_blocks(n) if value in _QMAX else 0
    return scales, data_nbytes(numel, encoding), index_nbytes(n) if k else 0


def encoded_nbytes(numel: int, encoding: str) -> int:
    """Payload bytes of a tensor of ``numel`` values in ``encoding`` (for cost models)."""
    return sum(frame_nbytes(numel, encoding))


def _blocks(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` zero-padded to whole blocks, as [n_blocks, BLOCK_SIZE]."""
    pad = -flat.numel() % BLOCK_SIZE
    return (flat if pad == 0 else torch.nn.functional.pad(flat, (0, pad))).view(-1, BLOCK_SIZE)


def encode(t: torch.Tensor, encoding: str) -> Encoded:
    """Encode ``t`` (any floating dtype, any shape) for the wire."""
    value, k = _parsed(encoding)
    flat = t.detach().reshape(-1).to(torch.float32)
    if k:
        positions = _top(flat, k)
        e = _encode_dense(flat[positions], value, flat.data_ptr())
        local = positions - positions.div(CHUNK, rounding_mode="floor") * CHUNK
        return Encoded(encoding, tuple(t.shape), t.dtype, e.data, e.scales, _pack12(local))
    e = _encode_dense(flat, encoding, t.data_ptr())
    return Encoded(encoding, tuple(t.shape), t.dtype, e.data, e.scales)


def _top(flat: torch.Tensor, k: int) -> torch.Tensor:
    """The positions of the ``k`` largest magnitudes of every chunk of ``flat`` (of a shorter last
    chunk, its share of k), increasing. A non-finite value counts as the largest, so
    it is sent and the receiver's finiteness check sees it."""
    score = flat.abs().nan_to_num_(nan=math.inf)
    full = flat.numel() // CHUNK * CHUNK
    parts = []
    if full:
        body = score[:full].view(-1, CHUNK).topk(k, dim=1, sorted=False).indices.sort(dim=1).values
        parts.append(body.add_(torch.arange(0, full, CHUNK)[:, None]).view(-1))
    if full < flat.numel():
        tail = score[full:]
        parts.append(tail.topk(_tail_kept(tail.numel(), k), sorted=False).indices.sort().values.add_(full))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _pack12(local: torch.Tensor) -> torch.Tensor:
    """Positions in [0, 4096) packed two per three bytes (an odd count padded with a 0)."""
    pad = local.numel() % 2
    if pad:
        local = torch.cat([local, local.new_zeros(1)])
    a, b = local[0::2], local[1::2]
    out = torch.empty(a.numel(), 3, dtype=torch.uint8)
    out[:, 0] = a & 0xFF
    out[:, 1] = (a >> 8) | ((b & 0xF) << 4)
    out[:, 2] = b >> 4
    return out.view(-1)


def _unpack12(packed: torch.Tensor) -> torch.Tensor:
    """The positions ``_pack12`` packed (its padding included), as int64."""
    u = packed.view(-1, 3).long()
    out = torch.empty(u.shape[0], 2, dtype=torch.long)
    out[:, 0] = u[:, 0] | ((u[:, 1] & 0xF) << 8)
    out[:, 1] = (u[:, 1] >> 4) | (u[:, 2] << 4)
    return out.view(-1)


def positions(e: Encoded, k: int) -> torch.Tensor:
    """The flat positions of a sparse ``e``'s kept values (from its chunk-local ones)."""
    assert e.indices is not None, "sparse encodings carry positions"
    n = kept(e.numel, e.encoding)
    local = _unpack12(e.indices)[:n]
    return local.add_(torch.arange(n).div_(k, rounding_mode="floor").mul_(CHUNK))


def _encode_dense(flat: torch.Tensor, encoding: str, source_ptr: int) -> Encoded:
    """``flat`` (float32) in a value encoding; ``source_ptr``: the caller's tensor's storage (an
    fp32 payload must not alias it)."""
    shape, dtype = tuple(flat.shape), torch.float32
    if encoding == "fp32":
        return Encoded(encoding, shape, dtype, flat.clone() if flat.data_ptr() == source_ptr else flat)
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
    value, k = _parsed(e.encoding)
    if k:
        values = _decode_dense(_values_of(e, value))
        out = torch.zeros(e.numel, dtype=torch.float32)
        out[positions(e, k)] = values
        return out.view(e.shape)
    return _decode_dense(e)


def _values_of(e: Encoded, value: str) -> Encoded:
    """A sparse ``e``'s kept values, as the dense encoding they are in."""
    return Encoded(value, (kept(e.numel, e.encoding),), torch.float32, e.data, e.scales)


def _decode_dense(e: Encoded) -> torch.Tensor:
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
    parsed = parse(e.encoding)
    if parsed is None:
        return f"unknown encoding {e.encoding!r}"
    value, k = parsed
    if not k:
        return _check_dense(e)
    if e.indices is None or e.indices.dtype != torch.uint8 or e.indices.dim() != 1:
        return f"{e.encoding} needs a flat uint8 tensor of positions"
    n = kept(e.numel, e.encoding)
    if e.indices.numel() != index_nbytes(n):
        return f"{e.indices.numel()} bytes of positions for {n} kept values (expected {index_nbytes(n)})"
    problem = _check_dense(_values_of(e, value))
    if problem is not None:
        return problem
    local = _unpack12(e.indices)
    if local.numel() > n and int(local[n]) != 0:
        return "the positions' padding is not zero"
    local = local[:n]
    chunk = torch.arange(n).div_(k, rounding_mode="floor")
    last = e.numel // CHUNK  # the shorter last chunk, when there is one
    length = torch.where(chunk == last, e.numel - last * CHUNK, CHUNK)
    if n and bool((local >= length).any()):
        return "a position is outside its chunk"
    if n > 1 and not bool(((local[1:] > local[:-1]) | (chunk[1:] != chunk[:-1])).all()):
        return "positions in a chunk are not increasing (unsorted or repeated)"
    return None


def _check_dense(e: Encoded) -> str | None:
    """``check`` for a dense encoding."""
    if e.indices is not None:
        return f"{e.encoding} carries no positions"
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
