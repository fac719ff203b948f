"""The bytes of the state files: framed records and snapshots, durable marks, and the checks a
header must pass after its checksum (a CRC is no signature). Pure: no file is opened here.

Framing: ``magic(4) | body length (u64) | crc32(body) (u32)``, then the body ``json length (u32) |
JSON header | raw little-endian tensor bytes``. No pickle. A mark: ``magic | fragment | version |
end of its record`` and its crc32.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from ddiloco.core.fragments import FragmentLayout
from ddiloco.core.syncer import FragmentRecord
from ddiloco.service.syncer.store.errors import StateError

_FRAME = struct.Struct("<4sQI")  # magic, body length, crc32 of the body
_JLEN = struct.Struct("<I")
_RECORD, _SNAPSHOT = b"DDLR", b"DDLS"
_MARK = struct.Struct("<4sIQQ")  # magic, fragment, version, end of its record in frag-{p}.log
_MARK_CRC = struct.Struct("<I")
_MARK_MAGIC = b"DDLM"
MARK_SIZE = _MARK.size + _MARK_CRC.size
MARKS, MIRROR, LOCK = "durable.log", "durable.mirror.log", "syncer.lock"
FORMAT = 4
"""Version of the files in ``state/`` (2: records carry incarnations and sequence numbers, the
folder has a FORMAT file; 3: durable.log marks and syncer.lock; 4: durable.mirror.log, and FORMAT
with empty mark files from the first restore). Another version is refused at restore."""
_MAX_INT = 2**53  # versions, counters and sequence numbers in a header (JSON numbers past it lose bits)
# Only these dtypes may be named in a file; the name is never eval'd or used to import anything.
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}

Tensors = dict[str, torch.Tensor]


def _pack_mark(p: int, version: int, end: int) -> bytes:
    body = _MARK.pack(_MARK_MAGIC, p, version, end)
    return body + _MARK_CRC.pack(zlib.crc32(body))


def _unpack_mark(buf: bytes, pos: int) -> tuple[int, int, int] | None:
    """(fragment, version, end) of the mark at ``pos``, or None if it does not verify."""
    if len(buf) - pos < MARK_SIZE:
        return None
    body = buf[pos : pos + _MARK.size]
    (crc,) = _MARK_CRC.unpack_from(buf, pos + _MARK.size)
    magic, p, version, end = _MARK.unpack(body)
    if magic != _MARK_MAGIC or zlib.crc32(body) != crc:
        return None
    return p, version, end


def _torn_shape(buf: bytearray, pos: int, why: str) -> bool:
    """Whether damage at ``pos`` looks like an interrupted append: a prefix of the record, zeros
    to the end, or a full-length last record whose bytes never reached the disk (ext4)."""
    whole = why == "checksum mismatch" and _FRAME.size + _FRAME.unpack_from(buf, pos)[1] + pos == len(buf)
    return why.startswith("truncated") or not any(buf[pos:]) or whole


def _frame(magic: bytes, header: dict[str, Any], tensors: Tensors) -> list[Any]:
    """The pieces of one framed body, zero-copy where possible (fragments can be large)."""
    bufs, entries = [], []
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        bufs.append(t.reshape(-1).view(torch.uint8).numpy())  # raw bytes, little-endian hosts only
        entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size()])
    js = json.dumps({**header, "format": FORMAT, "tensors": entries}).encode()
    body: list[Any] = [_JLEN.pack(len(js)), js, *bufs]
    crc = 0
    for b in body:
        crc = zlib.crc32(b, crc)
    return [_FRAME.pack(magic, sum(memoryview(b).nbytes for b in body), crc), *body]


def _parse(buf: bytearray, pos: int, magic: bytes) -> tuple[int, dict[str, Any]] | str:
    """Verify the frame at ``pos``: (end offset, JSON header), or why it is not valid. A frame
    whose checksum holds but whose header is not ours says so ("bad header: ..."): that is never
    a torn append, and it must never surface as a traceback."""
    if len(buf) - pos < _FRAME.size:
        return "truncated header"
    m, n, crc = _FRAME.unpack_from(buf, pos)
    start = pos + _FRAME.size
    if m != magic:
        return "bad magic"
    if start + n > len(buf):
        return "truncated body"
    if zlib.crc32(memoryview(buf)[start : start + n]) != crc:
        return "checksum mismatch"
    end = start + n
    if n < _JLEN.size:
        return "bad header: the body is shorter than its length field"
    (jn,) = _JLEN.unpack_from(buf, start)
    data = start + _JLEN.size + jn
    if data > end:
        return f"bad header: a {jn}-byte header in a {n}-byte body"
    try:
        header = json.loads(bytes(buf[start + _JLEN.size : data]))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        return f"bad header: not JSON ({type(e).__name__})"
    if not isinstance(header, dict):
        return f"bad header: a JSON {type(header).__name__}, not an object"
    why = _check_tensors(header.get("tensors"), end - data)
    if why is not None:
        return f"bad header: {why}"
    header["_data"] = data  # where the tensor bytes begin
    return end, header


def _is_int(x: object, lo: int = 0, hi: int = _MAX_INT) -> bool:
    return type(x) is int and lo <= x <= hi


def _check_tensors(entries: object, nbytes: int) -> str | None:
    """Why the header's tensor list cannot describe the ``nbytes`` that follow it, or None."""
    if not isinstance(entries, list):
        return "no tensor list"
    total = 0
    for e in entries:
        if not (isinstance(e, list) and len(e) == 4 and isinstance(e[0], str) and e[1] in _DTYPES):
            return f"tensor entry {str(e)[:80]} is not [name, dtype, shape, bytes]"
        shape, size = e[2], e[3]
        if not (isinstance(shape, list) and len(shape) <= 8 and all(_is_int(d, 0, 2**31) for d in shape)):
            return f"tensor {e[0][:80]!r} has the shape {str(shape)[:80]}"
        numel = 1
        for d in shape:
            numel *= d
        if size != numel * _DTYPES[e[1]].itemsize:
            return f"tensor {e[0][:80]!r} of shape {shape} claims {str(size)[:40]} bytes"
        total += size
    if total != nbytes:
        return f"its tensors need {total} bytes, the body holds {nbytes}"
    return None


def _check_meta(meta: object) -> str | None:
    if not isinstance(meta, dict):
        return "fragment meta is not an object"
    for key in ("fragment", "version", "tokens_merged"):
        if not _is_int(meta.get(key)):
            return f"fragment meta {key} = {str(meta.get(key))[:40]} is not an integer in 0..2^53"
    return None


def _check_record(header: dict[str, Any]) -> str | None:
    """Why a fragment log record's header is not the shape ``append`` writes, or None."""
    if not _is_int(header.get("seq")):
        return "bad header: no sequence number"
    if not isinstance(header.get("syncer"), dict) or not isinstance(header.get("pieces"), list):
        return "bad header: no syncer state or pieces"
    why = _check_meta(header.get("meta"))
    return None if why is None else f"bad header: {why}"


def _check_snapshot(header: dict[str, Any]) -> str | None:
    """Why a snapshot's header is not the shape ``snapshot`` writes, or None."""
    if not (_is_int(header.get("seq")) and _is_int(header.get("snapshot"))):
        return "bad header: no sequence or snapshot number"
    if not isinstance(header.get("syncer"), dict) or not isinstance(header.get("signature"), list):
        return "bad header: no syncer state or layout signature"
    owned, frags = header.get("owned"), header.get("fragments")
    if not (isinstance(owned, list) and all(_is_int(p, 0, 65535) for p in owned)):
        return "bad header: no owned fragment list"
    if not isinstance(frags, list):
        return "bad header: no fragment list"
    for meta in frags:
        why = _check_meta(meta)
        if why is not None:
            return f"bad header: {why}"
    return None


def _describe(piece: list[Any] | None) -> str:
    return "nothing" if piece is None else f"{piece[0]!r} rows {piece[1]}:{piece[2]} shape {tuple(piece[3])}"


def _tensors(buf: bytearray, header: dict[str, Any]) -> Tensors:
    out, off = {}, header["_data"]
    for name, dtype, shape, nbytes in header["tensors"]:
        dt = _DTYPES[dtype]
        if nbytes == 0:
            out[name] = torch.empty(shape, dtype=dt)
        else:  # clone first: frombuffer at an odd offset may be misaligned for the dtype
            out[name] = (
                torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=off).clone().view(dt).reshape(shape)
            )
        off += nbytes
    return out


def _signature(layout: FragmentLayout) -> list[list[list[Any]]]:
    """The layout signature split per fragment, as JSON gives it back (lists, not tuples)."""
    return [[[pc.name, pc.row_start, pc.row_end, list(pc.shape)] for pc in pieces] for pieces in layout.fragments]


def _encode(rec: FragmentRecord) -> tuple[Tensors, dict[str, int]]:
    tensors = {f"v{i}": v for i, v in enumerate(rec.values)}
    tensors.update({f"m{i}": m for i, m in enumerate(rec.momentum or [])})
    return tensors, {"fragment": rec.fragment, "version": rec.version, "tokens_merged": rec.tokens_merged}


def _decode(tensors: Tensors, meta: dict[str, Any], pieces: Sequence[Any], where: str) -> FragmentRecord:
    """The record of one fragment; StateError (one line) when its tensors do not fit the layout
    (a checksum proves no more than that the bytes are the ones written)."""
    p = meta["fragment"]
    momentum = "m0" in tensors
    for i, pc in enumerate(pieces):
        for kind in ("v", "m") if momentum else ("v",):
            t = tensors.get(f"{kind}{i}")
            if t is None or tuple(t.shape) != tuple(pc.shape) or not t.is_floating_point():
                got = "nothing" if t is None else f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"
                raise StateError(
                    f"{where} holds {got} as {kind}{i} of fragment {p}, whose layout wants a float tensor of "
                    f"shape {tuple(pc.shape)}: the file is damaged; restore the run dir from a backup or use a "
                    "fresh --run-dir"
                )
    values = [tensors[f"v{i}"] for i in range(len(pieces))]
    moms = [tensors[f"m{i}"] for i in range(len(pieces))] if momentum else None
    return FragmentRecord(int(p), int(meta["version"]), int(meta["tokens_merged"]), values, moms)
