"""The wire format: multipart ``[header, tensor, tensor, ...]``; no pickle anywhere.

The header is UTF-8 JSON: ``{"v": SCHEMA, "type": NAME, "fields": {...}, "tensors": [[field,
key, dtype, shape], ...]}``; each following frame holds one tensor's raw little-endian bytes,
sent without copies (``copy=False`` on the socket).

``decode`` is total: whatever list of byte strings it is given, it returns a valid message or
raises ``WireError`` with a reason, so a malformed message is counted and dropped, never a
crash. Every input is bounded before it can cost anything: the header's size (``MAX_HEADER``),
its JSON nesting (``MAX_DEPTH``, measured before the parser recurses) and the digits of its
numbers; the number of frames (``MAX_TENSORS``); every field's type, and its range or length
as declared in the message classes' field metadata (``min``/``max``/``max_len``/``each``, see
``ddiloco.core.messages``); tensor dtypes, ranks (``MAX_DIMS``), dimensions (``MAX_DIM``) and
byte sizes. ``encode`` runs the same field checks and refuses (ValueError/TypeError) a message
that ``decode`` would refuse, so a bug cannot put an invalid message on the wire.

A transport should also refuse oversized frames before they are buffered: ``max_frame_bytes``
gives the largest frame a model's messages need (ZeroMQ's ``MAXMSGSIZE``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ddiloco.core import compress
from ddiloco.core.compress import Encoded
from ddiloco.core.fragments import FragmentLayout
from ddiloco.core.messages import Ack, Contribution, FragmentRequest, FragmentUpdate, Heartbeat, Leave
from ddiloco.protocol.messages import (
    FetchGlobal,
    GlobalState,
    JoinReply,
    PeerState,
    PeerStateRequest,
    Register,
    RunEnd,
    RunSettings,
    SettingsRequest,
    StatusReply,
    StatusRequest,
    SyncerHeartbeat,
)
from ddiloco.service.base.wire_schemas import OLDEST_SERVED, REFUSAL_FIELDS, SCHEMA, served, unknown_to

_ALL = (Heartbeat, Contribution, Ack, FragmentRequest, FragmentUpdate, Register, JoinReply, Leave, SyncerHeartbeat)
_OTHERS = (PeerStateRequest, PeerState, FetchGlobal, GlobalState, RunEnd, StatusRequest, StatusReply)
MESSAGES: dict[str, type] = {cls.__name__: cls for cls in (*_ALL, *_OTHERS, SettingsRequest, RunSettings)}
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "int8": torch.int8,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_ITEMSIZE = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}
_NP_VIEW = {torch.bfloat16: torch.int16}  # numpy has no bfloat16: move the bits as int16
_NP_DTYPE = {k: torch.empty((), dtype=_NP_VIEW.get(v, v)).numpy().dtype for k, v in DTYPES.items()}

MAX_HEADER = 1 << 20
"""Largest header frame (bytes)."""
MAX_DEPTH = 16
"""Deepest JSON nesting of a header (the messages need 5: header, fields, list, item, shape)."""
MAX_TENSORS = 100_000
"""Most tensor frames in one message."""
MAX_DIMS = 8
"""Highest tensor rank."""
MAX_DIM = 2**31
"""Largest tensor dimension."""
MAX_STR = 1024
"""Longest string (or dict key) where a field declares no ``max_len``."""
MAX_ITEMS = 100_000
"""Longest list or dict where a field declares no ``max_len``."""
MAX_INT = 2**63 - 1
"""Largest magnitude of an integer inside an untyped (``Any``) value."""
_MAX_DIGITS = 24  # characters of an integer literal the parser may convert (2**63 has 19 digits)
_MAX_FLOAT_CHARS = 64  # characters of a float literal (repr needs at most 24)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)  # always matches: linear
_LONG_NUMBER = re.compile(rb"\d{%d}" % (_MAX_DIGITS + 1))
_MAX_ENCODING_CHARS = 16  # the longest encoding name ("bf16+top4095" has 12)
_BUG = "decode bug"  # prefix of a WireError that wraps an unexpected exception (the fuzz tests look for it)


def max_frame_bytes(largest_numel: int, itemsize: int = max(_ITEMSIZE.values())) -> int:
    """The largest frame a message of a model can need, in bytes: the transport's MAXMSGSIZE.

    A frame is either the header (at most ``MAX_HEADER``) or one tensor: a piece of a fragment
    (at most one parameter) or one optimizer-state tensor of a parameter. ``largest_numel`` is
    therefore ``max(p.numel() for p in model.parameters())``; ``itemsize`` is the widest dtype
    sent (8 by default: int64, the widest in ``DTYPES``; 4 when only float32 and narrower go).
    """
    if isinstance(largest_numel, bool) or not isinstance(largest_numel, int) or largest_numel < 0:
        raise ValueError(f"largest_numel must be a non-negative integer, got {largest_numel!r}")
    return max(MAX_HEADER, largest_numel * itemsize)


class WireError(ValueError):
    """A message that cannot be decoded; the reason names what is wrong."""


class SchemaMismatch(WireError):
    """A message of a wire schema this build does not serve (``wire_schemas``): ``theirs`` is
    the schema it carries, ``kind`` the message type it names (unchecked: for the answer only)."""

    def __init__(self, theirs: int, kind: str) -> None:
        serves = f"serves {OLDEST_SERVED} to {SCHEMA}"
        super().__init__(f"unsupported schema version {_show(theirs)} (this build speaks {SCHEMA}, {serves})")
        self.theirs = theirs
        self.kind = kind


# -- showing a value in an error: bounded, and safe for huge integers ----------------------------


def _show(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# -- per-class plans: type hints, bounds and checkers, resolved once per class ----------------

Checker = Callable[[Any], Any]


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """Field annotations of a message class (resolving them is slow: once per class)."""
    return typing.get_type_hints(cls)


def _is_tensor_list(tp: Any) -> bool:
    return typing.get_origin(tp) is list and typing.get_args(tp) == (torch.Tensor,)


def _is_tensor_dict(tp: Any) -> bool:
    return typing.get_origin(tp) is dict and typing.get_args(tp) == (str, torch.Tensor)


def _is_encoded_list(tp: Any) -> bool:
    return typing.get_origin(tp) is list and typing.get_args(tp) == (Encoded,)


ENCODED_FOR = {"encoded": "values"}
"""An encoded field and the tensor field it stands for: a message whose encoded list is not empty
sends it instead (one frame per piece: its float32 scales, if any, then its codes), and the
receiver's ``values`` are what it decodes to."""


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What decode and encode need to know about one message class."""

    values: tuple[tuple[str, Checker], ...]
    """Non-tensor fields and their checkers, in declaration order."""
    required: frozenset[str]
    """Non-tensor fields without a default (they must be on the wire)."""
    tensors: tuple[str, ...]
    """Tensor fields (a list or a dict of tensors), in declaration order."""
    tensor_lists: frozenset[str]
    tensor_dicts: frozenset[str]
    encoded: frozenset[str]
    """Lists of ``Encoded`` (sent in place of their ``ENCODED_FOR`` tensor list when not empty)."""
    names: frozenset[str]
    """Every non-tensor field name."""


@functools.cache
def _plan(cls: type) -> _Plan:
    hints = _hints(cls)
    values: list[tuple[str, Checker]] = []
    tensors: list[str] = []
    required: set[str] = set()
    lists: set[str] = set()
    dicts: set[str] = set()
    encoded: set[str] = set()
    for fl in dataclasses.fields(cls):
        tp = hints[fl.name]
        if _is_tensor_list(tp) or _is_tensor_dict(tp) or _is_encoded_list(tp):
            tensors.append(fl.name)
            if _is_encoded_list(tp):
                encoded.add(fl.name)
            else:
                (lists if _is_tensor_list(tp) else dicts).add(fl.name)
        else:
            values.append((fl.name, _checker(tp, fl.metadata, f"{cls.__name__}.{fl.name}", 3)))
            if fl.default is dataclasses.MISSING and fl.default_factory is dataclasses.MISSING:
                required.add(fl.name)
    names = frozenset(n for n, _ in values)
    return _Plan(
        tuple(values),
        frozenset(required),
        tuple(tensors),
        frozenset(lists),
        frozenset(dicts),
        frozenset(encoded),
        names,
    )


def _range(meta: Mapping[str, Any], where: str, tp: Any) -> tuple[Any, Any]:
    if "min" not in meta or "max" not in meta:
        raise TypeError(f"{where}: a numeric field needs min/max bounds in its field metadata")
    lo, hi = meta["min"], meta["max"]
    if tp is float and not (math.isfinite(lo) and math.isfinite(hi)):
        raise TypeError(f"{where}: float bounds must be finite")
    return lo, hi


def _checker(tp: Any, meta: Mapping[str, Any], where: str, depth: int) -> Checker:
    """A function that returns a JSON value as the field's type, or raises WireError.

    ``meta`` holds the field's bounds: ``min``/``max`` for numbers (and for the numbers in a list
    or dict), ``max_len`` for strings, lists and dicts, ``each`` for every element of a list (a
    function that takes any JSON value and returns why it is not a valid element, or None; it
    replaces the element type's own check, so it must check everything). ``depth`` is the JSON nesting
    of the value (the header
    object is 1, its ``fields`` 2, a field's value 3).
    """
    origin = typing.get_origin(tp)
    if tp is int:
        return _int_checker(meta, where)
    if tp is float:
        return _float_checker(meta, where)
    if tp is bool:
        return _bool_checker(where)
    if tp is str:
        return functools.partial(_check_str, where=where, max_len=meta.get("max_len", MAX_STR))
    if origin is typing.Literal:
        return _literal_checker(typing.get_args(tp), where)
    if origin is list:
        return _list_checker(tp, meta, where, depth)
    if origin is dict:
        return _dict_checker(tp, meta, where, depth)
    if origin in (typing.Union, types.UnionType):
        return _union_checker(tp, meta, where, depth)
    if tp is type(None):
        return _none_checker(where)
    if tp is Any:
        return functools.partial(_check_any, where=where, depth=depth)
    raise TypeError(f"{where}: unsupported field type {tp}")


def _int_checker(meta: Mapping[str, Any], where: str) -> Checker:
    lo, hi = _range(meta, where, int)

    def check_int(v: Any) -> Any:
        if type(v) is not int or not lo <= v <= hi:  # type(): a bool is never an int
            raise WireError(f"{where}: {_show(v)} is not an integer in [{lo}, {hi}]")
        return v

    return check_int


def _float_checker(meta: Mapping[str, Any], where: str) -> Checker:
    lo, hi = _range(meta, where, float)

    def check_float(v: Any) -> Any:
        # An int is compared exactly (no float conversion that could overflow); nan fails both.
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            raise WireError(f"{where}: {_show(v)} is not a finite number in [{lo}, {hi}]")
        return float(v)

    return check_float


def _bool_checker(where: str) -> Checker:
    def check_bool(v: Any) -> Any:
        if type(v) is not bool:
            raise WireError(f"{where}: expected true or false, got {_show(v)}")
        return v

    return check_bool


def _literal_checker(options: tuple[Any, ...], where: str) -> Checker:
    def check_literal(v: Any) -> Any:
        if not any(type(v) is type(o) and v == o for o in options):
            raise WireError(f"{where}: {_show(v)} is not one of {options}")
        return v

    return check_literal


def _list_checker(tp: Any, meta: Mapping[str, Any], where: str, depth: int) -> Checker:
    (inner,) = typing.get_args(tp) or (Any,)
    item = _checker(inner, _element_meta(meta), where, depth + 1)
    each = meta.get("each")
    max_len = meta.get("max_len", MAX_ITEMS)

    def check_list(v: Any) -> Any:
        if not isinstance(v, (list, tuple)):
            raise WireError(f"{where}: expected a list, got {_show(v)}")
        if len(v) > max_len:
            raise WireError(f"{where}: {len(v)} items, at most {max_len}")
        if each is None:
            return [item(x) for x in v]
        for i, x in enumerate(v):  # ``each`` validates a whole element (any JSON value), faster
            reason = each(x)
            if reason is not None:
                raise WireError(f"{where}[{i}]: {reason}")
        return list(v)

    return check_list


def _dict_checker(tp: Any, meta: Mapping[str, Any], where: str, depth: int) -> Checker:
    k_tp, v_tp = typing.get_args(tp) or (str, Any)
    if k_tp is not str:
        raise TypeError(f"{where}: JSON objects have string keys, not {k_tp}")
    value = _checker(v_tp, _element_meta(meta), where, depth + 1)
    max_len = meta.get("max_len", MAX_ITEMS)

    def check_dict(v: Any) -> Any:
        if not isinstance(v, dict):
            raise WireError(f"{where}: expected an object, got {_show(v)}")
        if len(v) > max_len:
            raise WireError(f"{where}: {len(v)} entries, at most {max_len}")
        return {_check_str(k, where=f"{where} key"): value(x) for k, x in v.items()}

    return check_dict


def _union_checker(tp: Any, meta: Mapping[str, Any], where: str, depth: int) -> Checker:
    checkers = [_checker(o, meta, where, depth) for o in typing.get_args(tp)]

    def check_union(v: Any) -> Any:
        for option in checkers:
            try:
                return option(v)
            except WireError:
                continue
        raise WireError(f"{where}: {_show(v)} matches none of {tp}")

    return check_union


def _none_checker(where: str) -> Checker:
    def check_none(v: Any) -> Any:
        if v is not None:
            raise WireError(f"{where}: expected null, got {_show(v)}")
        return None

    return check_none


def _element_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    """A container's bounds as they apply to its elements (numbers keep min/max; no length)."""
    return {k: v for k, v in meta.items() if k in ("min", "max")}


def _check_str(v: Any, *, where: str, max_len: int = MAX_STR) -> str:
    if not isinstance(v, str):
        raise WireError(f"{where}: expected a string, got {_show(v)}")
    if len(v) > max_len:
        raise WireError(f"{where}: a string of {len(v)} characters, at most {max_len}")
    if not v.isascii():
        try:
            v.encode()
        except UnicodeEncodeError:  # a lone surrogate from a \\ud800 escape: it would break every log line
            raise WireError(f"{where}: not valid Unicode") from None
    return v


def _check_any(value: Any, *, where: str, depth: int) -> Any:
    """An untyped JSON value: bounded nesting, sizes, strings and numbers (iteratively).

    The scalars of a container are checked inline, by exact type (what JSON decodes to); any
    other type (a tuple, a float subclass on encode) takes the generic path.
    """
    stack = [(value, depth)]
    while stack:
        v, d = stack.pop()
        if not isinstance(v, (list, tuple, dict)):
            _check_scalar(v, where)
            continue
        if d > MAX_DEPTH:
            raise WireError(f"{where}: nested deeper than {MAX_DEPTH}")
        if len(v) > MAX_ITEMS:
            raise WireError(f"{where}: {len(v)} items, at most {MAX_ITEMS}")
        if isinstance(v, dict):
            for k in v:
                _check_str(k, where=f"{where} key")
        for x in v.values() if isinstance(v, dict) else v:
            t = type(x)
            if t is int:
                if not -MAX_INT <= x <= MAX_INT:
                    raise WireError(f"{where}: {_show(x)} is out of [-{MAX_INT}, {MAX_INT}]")
            elif t is float:
                if not math.isfinite(x):
                    raise WireError(f"{where}: {x!r} is not finite")
            elif t is str:
                if len(x) > MAX_STR or not x.isascii():
                    _check_str(x, where=where)
            elif x is not None and t is not bool:
                stack.append((x, d + 1))
    return value


def _check_scalar(v: Any, where: str) -> None:
    if v is None or isinstance(v, bool):
        return
    if isinstance(v, int):
        if not -MAX_INT <= v <= MAX_INT:
            raise WireError(f"{where}: {_show(v)} is out of [-{MAX_INT}, {MAX_INT}]")
    elif isinstance(v, float):
        if not math.isfinite(v):
            raise WireError(f"{where}: {v!r} is not finite")
    elif isinstance(v, str):
        _check_str(v, where=where)
    else:
        raise WireError(f"{where}: {type(v).__name__} is not a JSON value")


# -- encode -------------------------------------------------------------------------------------


def encode(msg: Any, schema: int = SCHEMA) -> list[Any]:
    """Frames for ``msg``: a JSON header, then one buffer per tensor (no copies); for a peer of an
    older, served ``schema``, in its schema: without the fields it does not know.

    Raises TypeError for what is not a message or not encodable (an unsupported dtype), and
    ValueError for a message that breaks a bound (``decode`` would refuse it).
    """
    cls: type = type(msg)
    name = cls.__name__
    if MESSAGES.get(name) is not cls:
        raise TypeError(f"not a wire message: {name}")
    if not served(schema):
        raise ValueError(f"refusing to encode {name} in wire schema {schema}: this build serves none but its own")
    plan = _plan(cls)
    fields: dict[str, Any] = {}
    specs: list[list[Any]] = []
    frames: list[Any] = []
    unknown = unknown_to(schema, name)
    try:
        for f, check in plan.values:
            value = getattr(msg, f)
            check(value)
            if f not in unknown:
                fields[f] = value
        _tensor_frames(msg, name, plan, specs, frames)
        if len(frames) > MAX_TENSORS:
            raise WireError(f"{name}: {len(frames)} tensors, at most {MAX_TENSORS}")
    except WireError as e:
        raise ValueError(f"refusing to encode {name}: {e}") from None
    header = json.dumps(
        {"v": schema, "type": name, "fields": fields, "tensors": specs}, separators=(",", ":"), allow_nan=False
    ).encode()
    if len(header) > MAX_HEADER:
        raise ValueError(f"refusing to encode {name}: header of {len(header)} bytes exceeds {MAX_HEADER}")
    return [header, *frames]


def _tensor_frames(msg: Any, name: str, plan: _Plan, specs: list[list[Any]], frames: list[Any]) -> None:
    """Append ``msg``'s tensor fields to ``specs`` and ``frames``, each checked (WireError)."""
    replaced = {ENCODED_FOR[f] for f in plan.encoded if getattr(msg, f)}
    for f in plan.tensors:
        value = getattr(msg, f)
        if f in replaced:
            continue  # its encoded list goes instead
        if f in plan.encoded:
            for i, e in enumerate(value):
                problem = compress.check(e) if isinstance(e, Encoded) else "not an Encoded"
                if problem is not None or len(e.shape) > MAX_DIMS or any(d > MAX_DIM for d in e.shape):
                    raise WireError(f"{name}.{f}[{i}]: {problem or 'shape out of bounds'}")
                specs.append([f, i, e.encoding, list(e.shape)])
                frames.append(_encoded_frame(e))
            continue
        items = enumerate(value) if f in plan.tensor_lists else value.items()
        for key, t in items:
            if f in plan.tensor_dicts:
                _check_str(key, where=f"{name}.{f} key")
            t = t.detach().cpu().contiguous()
            dtype = _DTYPE_NAMES.get(t.dtype)
            if dtype is None:
                raise TypeError(f"{name}.{f}[{key}]: dtype {t.dtype} cannot go on the wire")
            if t.dim() > MAX_DIMS or any(d > MAX_DIM for d in t.shape):
                raise WireError(f"{name}.{f}[{key}]: shape {list(t.shape)} exceeds {MAX_DIMS} dims of {MAX_DIM}")
            specs.append([f, key, dtype, list(t.shape)])
            frames.append(t.view(_NP_VIEW.get(t.dtype, t.dtype)).numpy())


def _encoded_frame(e: Encoded) -> Any:
    """One frame for an encoded piece: its scales (float32), if any, its data, then a sparse
    one's positions."""
    t = e.data.detach().cpu().contiguous()
    data = t.view(_NP_VIEW.get(t.dtype, t.dtype)).numpy()
    if e.scales is None and e.indices is None:
        return data
    parts = [data.view(np.uint8)]
    if e.scales is not None:
        parts.insert(0, e.scales.detach().cpu().contiguous().numpy().view(np.uint8))
    if e.indices is not None:
        parts.append(e.indices.detach().cpu().contiguous().numpy())
    return np.concatenate(parts)


def _decode_encoded(where: str, encoding: str, shape: list[int], buf: memoryview) -> Encoded:
    """An encoded piece from its frame (sizes already checked), checked before it is decoded."""
    n_scales, n_data, _ = compress.frame_nbytes(math.prod(shape), encoding)
    raw = np.frombuffer(buf, dtype=np.uint8)
    value, k = compress.parse(encoding) or (encoding, 0)  # _spec has parsed it: a sparse one's values
    # an int encoding carries its scales, a sparse one its positions: empty tensors for an empty piece
    scales = torch.from_numpy(raw[:n_scales].copy().view(np.float32)) if value in ("int8", "int4", "int2") else None
    dtype = compress.DATA_DTYPE[value]
    data = torch.from_numpy(raw[n_scales : n_scales + n_data].copy().view(_NP_DTYPE[_DTYPE_NAMES[dtype]])).view(dtype)
    indices = torch.from_numpy(raw[n_scales + n_data :].copy()) if k else None
    e = Encoded(encoding, tuple(shape), torch.float32, data, scales, indices)
    problem = compress.check(e)
    if problem is not None:
        raise WireError(f"{where}: {problem}")
    return e


# -- decode -------------------------------------------------------------------------------------


def _buffer(frame: Any) -> memoryview:
    """The bytes of a frame: a zmq.Frame, bytes, or any C-contiguous buffer (an encoded ndarray)."""
    try:
        view = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
    except TypeError:
        view = None
    if view is None or not view.c_contiguous:
        raise WireError(f"a frame is not a contiguous byte buffer ({type(frame).__name__})")
    return view


def _depth(raw: bytes) -> int:
    """The deepest nesting of brackets outside JSON strings (at least the parser's depth)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return 0  # cannot nest deeper than there are openers: the usual, cheap case
    bare = np.frombuffer(_STRING.sub(b'""', raw), dtype=np.uint8)
    step = ((bare == ord("[")) | (bare == ord("{"))).astype(np.int32)
    step -= (bare == ord("]")) | (bare == ord("}"))
    return int(np.cumsum(step).max(initial=0))


def _parse_int(text: str) -> int:
    if len(text) > _MAX_DIGITS:
        raise WireError(f"an integer of {len(text)} digits")
    return int(text)


def _parse_float(text: str) -> float:
    if len(text) > _MAX_FLOAT_CHARS:
        raise WireError(f"a number of {len(text)} characters")
    return float(text)


def _parse_constant(text: str) -> Any:
    raise WireError(f"{text} is not a finite number")


def _parse(raw: bytes) -> Any:
    """The header's JSON, parsed only once its nesting and its numbers are known to be small."""
    if _depth(raw) > MAX_DEPTH:
        raise WireError(f"header nested deeper than {MAX_DEPTH}")
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise WireError("header is not UTF-8") from None
    # A long run of digits may be a huge number (slow to convert, and past Python's int-string
    # limit): only then parse numbers through length-checking hooks (a call per number).
    long = _LONG_NUMBER.search(raw) is not None
    try:
        return json.loads(
            text,
            parse_constant=_parse_constant,
            parse_int=_parse_int if long else None,
            parse_float=_parse_float if long else None,
        )
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; so is WireError
        raise WireError(f"header is not JSON: {e}" if not isinstance(e, WireError) else f"header: {e}") from None


def largest_piece(layout: FragmentLayout) -> int:
    """``decode``'s ``max_numel`` for a peer of this layout: the values of its largest piece (every
    encoded piece of a contribution or a version is one of the layout's pieces)."""
    return max((pc.numel for frag in layout.fragments for pc in frag), default=0)


def decode(frames: Any, max_numel: int | None = None) -> Any:
    """The message in ``frames``, or WireError naming what is malformed (never another exception).
    ``max_numel``: the most values an encoded piece may decode to (the receiver's largest
    parameter): a sparse piece's frame is ~1/9,000 of what it decodes to, so the frame bound
    alone does not bound the memory it asks for."""
    return decode_from(frames, max_numel)[0]


def decode_from(frames: Any, max_numel: int | None = None) -> tuple[Any, int]:
    """The message in ``frames`` and the wire schema its sender speaks (a served one: ``SCHEMA``
    or older), or WireError naming what is malformed; ``SchemaMismatch`` for a schema not served.
    ``max_numel`` as in ``decode``."""
    try:
        return _decode(frames, max_numel)
    except WireError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, RecursionError) as e:
        # Defence in depth: every check above should have caught it. The fuzz tests fail on this.
        raise WireError(f"{_BUG}: {type(e).__name__}: {_show(str(e))}") from None
    except (RuntimeError, MemoryError) as e:  # an allocation the checks let through: the message's fault
        raise WireError(f"{_BUG}: {type(e).__name__}: {_show(str(e))}") from None


def _decode(frames: Any, max_numel: int | None = None) -> tuple[Any, int]:
    cls, fields, specs, schema = _header(frames)
    plan = _plan(cls)
    # the header first: no tensor is copied for a message refused anyway
    kwargs = _values(cls.__name__, plan, fields, unknown_to(schema, cls.__name__))
    layout = [_spec(cls.__name__, spec, frame, plan, max_numel) for spec, frame in zip(specs, frames[1:])]
    kwargs.update(_tensor_fields(cls.__name__, plan, layout))
    return cls(**kwargs), schema


def refusal(reason: str, epoch: int, schema: int) -> list[Any]:
    """A ``JoinReply`` refusal in any ``schema`` since 2, served or not: only the fields each of
    them has (``wire_schemas.REFUSAL_FIELDS``), so a peer this build cannot serve still reads why."""
    reply = JoinReply(accepted=False, reason=reason, epoch=epoch, data_position=0, owned=[])
    frames = encode(reply)
    header = json.loads(bytes(frames[0]))
    header["v"] = schema
    header["fields"] = {f: header["fields"][f] for f in REFUSAL_FIELDS}
    return [json.dumps(header, separators=(",", ":")).encode()]


def _header(frames: Any) -> tuple[type, dict[str, Any], list[Any], int]:
    """The message class, fields and tensor specs that the header frame announces, checked
    against the frames (before any tensor byte is looked at)."""
    if not isinstance(frames, (list, tuple)):
        raise WireError(f"frames must be a list, got {type(frames).__name__}")
    if not frames:
        raise WireError("empty message")
    if len(frames) - 1 > MAX_TENSORS:
        raise WireError(f"{len(frames) - 1} tensor frames, at most {MAX_TENSORS}")
    raw = _buffer(frames[0])
    if raw.nbytes > MAX_HEADER:
        raise WireError(f"header of {raw.nbytes} bytes exceeds {MAX_HEADER}")
    header = _parse(raw.tobytes())
    if not isinstance(header, dict):
        raise WireError("header is not a JSON object")
    schema = header.get("v")
    if type(schema) is not int:
        raise WireError(f"unsupported schema version {_show(schema)} (this build speaks {SCHEMA})")
    if not served(schema):
        kind = header.get("type")
        raise SchemaMismatch(schema, kind[:64] if isinstance(kind, str) else "")
    if set(header) != {"v", "type", "fields", "tensors"}:
        raise WireError(f"header keys {sorted(header)!r}, expected v, type, fields, tensors")
    kind = header["type"]
    cls = MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise WireError(f"unknown message type {_show(kind)}")
    fields, specs = header["fields"], header["tensors"]
    if not isinstance(fields, dict) or not isinstance(specs, list):
        raise WireError("header lacks fields/tensors")
    if len(specs) != len(frames) - 1:
        raise WireError(f"{len(specs)} tensors announced, {len(frames) - 1} frames sent")
    return cls, fields, specs, schema


def _values(name: str, plan: _Plan, fields: dict[str, Any], newer: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The non-tensor fields, each checked; WireError for an unknown or a missing one (``newer``:
    fields the sender's schema does not have; they take their defaults)."""
    unknown = set(fields) - (plan.names - newer)
    if unknown:
        raise WireError(f"{name}: unknown fields {_show(', '.join(sorted(unknown)))}")
    kwargs: dict[str, Any] = {}
    for f, check in plan.values:
        if f in fields:
            kwargs[f] = check(fields[f])
        elif f in plan.required:
            raise WireError(f"{name}: missing field {f!r}")
    return kwargs


def _tensor_fields(name: str, plan: _Plan, layout: list[tuple[str, Any, str, list[int], memoryview]]) -> dict[str, Any]:
    """The tensor fields from their checked frames: lists in index order, dicts without a key
    twice, and an encoded list decoded into the tensor list it stands for."""
    out: dict[str, Any] = {f: [] for f in (*plan.tensor_lists, *plan.encoded)}
    out.update({f: {} for f in plan.tensor_dicts})
    for f, key, dtype, shape, buf in layout:
        if f in plan.encoded:
            if key != len(out[f]):
                raise WireError(f"{name}.{f}: piece index {_show(key)} out of order")
            out[f].append(_decode_encoded(f"{name}.{f}[{key}]", dtype, shape, buf))
            continue
        arr = np.frombuffer(buf, dtype=_NP_DTYPE[dtype]).copy()  # own the bytes
        t = torch.from_numpy(arr).view(DTYPES[dtype]).reshape(shape)
        if f in plan.tensor_lists:
            if key != len(out[f]):
                raise WireError(f"{name}.{f}: tensor index {_show(key)} out of order")
            out[f].append(t)
        else:
            if key in out[f]:
                raise WireError(f"{name}.{f}: tensor {key!r} sent twice")
            out[f][key] = t
    for f in plan.encoded:
        if out[f]:
            target = ENCODED_FOR[f]
            if out[target]:
                raise WireError(f"{name}: both {target} and {f} sent")
            out[target] = [compress.decode(e) for e in out[f]]
    return out


def _spec(
    name: str, spec: Any, frame: Any, plan: _Plan, max_numel: int | None = None
) -> tuple[str, Any, str, list[int], memoryview]:
    """A tensor spec checked against its frame (before any byte is copied)."""
    if not (isinstance(spec, list) and len(spec) == 4):
        raise WireError("tensor spec must be [field, key, dtype, shape]")
    f, key, dtype, shape = spec
    if not isinstance(f, str) or f not in plan.tensors:
        raise WireError(f"{name}: tensor for unknown field {_show(f)}")
    where = f"{name}.{f}"
    if f in plan.tensor_lists or f in plan.encoded:
        if type(key) is not int:
            raise WireError(f"{where}: tensor index {_show(key)} is not an integer")
    else:
        _check_str(key, where=f"{where} key")
    if f in plan.encoded:
        known = isinstance(dtype, str) and len(dtype) <= _MAX_ENCODING_CHARS and compress.parse(dtype) is not None
    else:
        known = isinstance(dtype, str) and dtype in DTYPES
    if not known:
        what = "encoding" if f in plan.encoded else "dtype"
        raise WireError(f"{where}[{_show(key)}]: unsupported {what} {_show(dtype)}")
    if not (
        isinstance(shape, list) and len(shape) <= MAX_DIMS and all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)
    ):
        raise WireError(f"{where}[{_show(key)}]: bad shape {_show(shape)} (at most {MAX_DIMS} dims in [0, {MAX_DIM}])")
    if f in plan.encoded and max_numel is not None and math.prod(shape) > max_numel:
        raise WireError(f"{where}[{_show(key)}]: {math.prod(shape)} values, more than this model's largest piece")
    buf = _buffer(frame)
    if f in plan.encoded:
        expected = compress.encoded_nbytes(math.prod(shape), dtype)
    else:
        expected = math.prod(shape) * _ITEMSIZE[dtype]
    if buf.nbytes != expected:
        raise WireError(f"{where}[{_show(key)}]: {buf.nbytes} bytes, expected {expected} for {dtype}{shape}")
    return f, key, dtype, shape, buf
