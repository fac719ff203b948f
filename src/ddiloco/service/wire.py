"""The wire format: multipart ``[header, tensor, tensor, ...]``; no pickle anywhere.

The header is UTF-8 JSON: ``{"v": SCHEMA, "type": NAME, "fields": {...}, "tensors": [[field,
key, dtype, shape], ...]}``; each following frame holds one tensor's raw little-endian bytes,
sent without copies (``copy=False`` on the socket). ``decode`` checks everything (schema
version, type, every field's type, tensor count, dtype, byte size) and raises ``WireError``
with a reason, so a malformed message is counted and dropped, never a crash.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from typing import Any

import numpy as np
import torch

from ddiloco.core.messages import Ack, Contribution, FragmentRequest, FragmentUpdate, Heartbeat, Leave
from ddiloco.service.protocol import (
    FetchGlobal,
    GlobalState,
    JoinReply,
    PeerState,
    PeerStateRequest,
    Register,
    SyncerHeartbeat,
)

SCHEMA = 2  # 2: incarnations and sequence numbers, Register replaces Join
_ALL = (Heartbeat, Contribution, Ack, FragmentRequest, FragmentUpdate, Register, JoinReply, Leave, SyncerHeartbeat)
MESSAGES: dict[str, type] = {
    cls.__name__: cls for cls in (*_ALL, PeerStateRequest, PeerState, FetchGlobal, GlobalState)
}
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "int8": torch.int8,
}
_NP_VIEW = {torch.bfloat16: torch.int16}  # numpy has no bfloat16: move the bits as int16
MAX_HEADER = 1 << 20


class WireError(ValueError):
    """A message that cannot be decoded; the reason names what is wrong."""


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """Field annotations of a message class (resolving them is slow: once per class)."""
    return typing.get_type_hints(cls)


@functools.cache
def _optional(cls: type) -> frozenset[str]:
    """Fields of a message class that have a default (may be missing on the wire)."""
    return frozenset(
        fl.name
        for fl in dataclasses.fields(cls)
        if fl.default is not dataclasses.MISSING or fl.default_factory is not dataclasses.MISSING
    )


def _is_tensor_list(tp: Any) -> bool:
    return typing.get_origin(tp) is list and typing.get_args(tp) == (torch.Tensor,)


def _is_tensor_dict(tp: Any) -> bool:
    return typing.get_origin(tp) is dict and typing.get_args(tp) == (str, torch.Tensor)


def encode(msg: Any) -> list[Any]:
    """Frames for ``msg``: a JSON header, then one buffer per tensor (no copies)."""
    name = type(msg).__name__
    if name not in MESSAGES:
        raise TypeError(f"not a wire message: {name}")
    fields: dict[str, Any] = {}
    specs: list[list[Any]] = []
    frames: list[Any] = []
    for f, tp in _hints(type(msg)).items():
        value = getattr(msg, f)
        if _is_tensor_list(tp) or _is_tensor_dict(tp):
            items = enumerate(value) if _is_tensor_list(tp) else value.items()
            for key, t in items:
                t = t.detach().cpu().contiguous()
                dtype = next(k for k, v in DTYPES.items() if v == t.dtype)
                specs.append([f, key, dtype, list(t.shape)])
                frames.append(t.view(_NP_VIEW.get(t.dtype, t.dtype)).numpy())
        else:
            fields[f] = value
    header = json.dumps({"v": SCHEMA, "type": name, "fields": fields, "tensors": specs}, separators=(",", ":")).encode()
    return [header, *frames]


def _buffer(frame: Any) -> memoryview:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame)


def decode(frames: list[Any]) -> Any:
    """The message in ``frames``, or WireError naming what is malformed."""
    if not frames:
        raise WireError("empty message")
    raw = _buffer(frames[0])
    if raw.nbytes > MAX_HEADER:
        raise WireError(f"header of {raw.nbytes} bytes exceeds {MAX_HEADER}")
    try:
        header = json.loads(raw.tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WireError("header is not UTF-8 JSON") from None
    if not isinstance(header, dict) or header.get("v") != SCHEMA:
        raise WireError(
            f"unsupported schema version {header.get('v') if isinstance(header, dict) else None!r} (this build "
            f"speaks {SCHEMA})"
        )
    cls = MESSAGES.get(header.get("type"))
    if cls is None:
        raise WireError(f"unknown message type {header.get('type')!r}")
    fields, specs = header.get("fields"), header.get("tensors")
    if not isinstance(fields, dict) or not isinstance(specs, list):
        raise WireError("header lacks fields/tensors")
    if len(specs) != len(frames) - 1:
        raise WireError(f"{len(specs)} tensors announced, {len(frames) - 1} frames sent")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    tensor_fields = {f for f, tp in hints.items() if _is_tensor_list(tp) or _is_tensor_dict(tp)}
    for f in tensor_fields:
        kwargs[f] = [] if _is_tensor_list(hints[f]) else {}
    for spec, frame in zip(specs, frames[1:]):
        f, key, t = _tensor(spec, frame, tensor_fields)
        if _is_tensor_list(hints[f]):
            if key != len(kwargs[f]):
                raise WireError(f"{f}: tensor index {key} out of order")
            kwargs[f].append(t)
        else:
            kwargs[f][str(key)] = t
    defaults = _optional(cls)
    for f, tp in hints.items():
        if f in tensor_fields:
            continue
        if f not in fields:
            if f in defaults:
                continue
            raise WireError(f"{cls.__name__}: missing field {f!r}")
        kwargs[f] = _check(fields[f], tp, f"{cls.__name__}.{f}")
    unknown = set(fields) - set(hints)
    if unknown:
        raise WireError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    return cls(**kwargs)


def _tensor(spec: Any, frame: Any, tensor_fields: set[str]) -> tuple[str, Any, torch.Tensor]:
    if not (isinstance(spec, list) and len(spec) == 4):
        raise WireError("tensor spec must be [field, key, dtype, shape]")
    f, key, dtype, shape = spec
    if f not in tensor_fields:
        raise WireError(f"tensor for unknown field {f!r}")
    if dtype not in DTYPES:
        raise WireError(f"unsupported dtype {dtype!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise WireError(f"bad shape {shape!r}")
    tdt = DTYPES[dtype]
    buf = _buffer(frame)
    expected = math.prod(shape) * torch.empty((), dtype=tdt).element_size()
    if buf.nbytes != expected:
        raise WireError(f"tensor {f}[{key}]: {buf.nbytes} bytes, expected {expected} for {dtype}{shape}")
    view = _NP_VIEW.get(tdt, tdt)
    arr = np.frombuffer(buf, dtype=torch.empty((), dtype=view).numpy().dtype).copy()  # own the bytes
    return f, key, torch.from_numpy(arr).view(tdt).reshape(shape)


def _check(value: Any, tp: Any, where: str) -> Any:
    """Type-check a JSON value against a field annotation (the subset the messages use)."""
    origin = typing.get_origin(tp)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise WireError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise WireError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is bool or tp is str:
        if not isinstance(value, tp):
            raise WireError(f"{where}: expected {tp.__name__}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise WireError(f"{where}: expected a list")
        (inner,) = typing.get_args(tp) or (Any,)
        return [_check(v, inner, where) for v in value] if inner is not Any else value
    if origin is dict:
        if not isinstance(value, dict):
            raise WireError(f"{where}: expected an object")
        k_tp, v_tp = typing.get_args(tp)
        return {k: _check(v, v_tp, where) for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _check(value, option, where)
            except WireError:
                continue
        raise WireError(f"{where}: {value!r} matches none of {tp}")
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise WireError(f"{where}: {value!r} is not one of {typing.get_args(tp)}")
        return value
    if tp is type(None):
        if value is not None:
            raise WireError(f"{where}: expected null")
        return None
    if tp is Any or tp is dict or tp is list:
        return value
    raise WireError(f"{where}: unsupported field type {tp}")
