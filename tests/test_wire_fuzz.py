"""Decode is total: any frames give a valid message or a WireError, never another exception.

Three fuzzers: raw bytes (the parser's edges), random JSON under a valid envelope (the type
checks), and mutations of valid encoded messages of every type (the bounds, one field, one
tensor spec or one frame at a time, with the values the review used: 10**5000, nesting 10000
deep, 1e300, nan, inf, wrong types, missing and extra keys). A message that decodes must be
within bounds: encoding it again must succeed and give the same message back.
"""

from __future__ import annotations

import dataclasses
import json
import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_wire import MESSAGES, same

from ddiloco.service.base.wire import SCHEMA, WireError, decode, encode

torch.set_num_threads(1)
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decodes_or_refuses(frames) -> None:
    """The property: a message within bounds (it re-encodes to itself) or a WireError, nothing else."""
    try:
        msg = decode(frames)
    except WireError as e:
        assert not str(e).startswith("decode bug"), str(e)  # decode's last-resort net caught a stray exception
        assert len(str(e)) < 1000
        return
    within_bounds(msg)
    again = decode([bytes(memoryview(f)) for f in encode(msg)])
    assert type(again) is type(msg)
    for f in vars(msg):
        assert same(getattr(msg, f), getattr(again, f)), f


def within_bounds(msg) -> None:
    """The declared bounds, checked independently of wire.py's compiled checkers."""
    for fl in dataclasses.fields(msg):
        value, meta = getattr(msg, fl.name), fl.metadata
        if isinstance(value, (str, list, dict)):
            assert len(value) <= meta.get("max_len", 100_000), fl.name
        numbers = value if fl.type in ("list[int]",) else value.values() if fl.type == "dict[str, int]" else [value]
        for v in numbers if fl.type in ("int", "float", "list[int]", "dict[str, int]") else []:
            assert type(v) is (float if fl.type == "float" else int), (fl.name, v)
            assert math.isfinite(v) and meta["min"] <= v <= meta["max"], (fl.name, v)
        if "each" in meta:
            assert all(meta["each"](x) is None for x in value), fl.name


# -- 1: arbitrary bytes ---------------------------------------------------------------------------

JSONISH = st.lists(
    st.sampled_from(
        [b"[", b"]", b"{", b"}", b'"', b"\\", b":", b",", b"1", b"9" * 30, b"-", b"e", b".", b"NaN", b"\xff"]
    ),
    max_size=60,
).map(b"".join)


@FAST
@given(st.lists(st.one_of(st.binary(max_size=64), JSONISH), max_size=5))
def test_arbitrary_bytes(frames):
    decodes_or_refuses(frames)


# -- 2: random JSON in a valid envelope -------------------------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


def fields_of(name: str) -> list[str]:
    msg = next(m for m in MESSAGES if type(m).__name__ == name)
    return list(json.loads(bytes(memoryview(encode(msg)[0])))["fields"])


NAMES = sorted({type(m).__name__ for m in MESSAGES})


@FAST
@given(st.data())
def test_random_json_fields(data):
    name = data.draw(st.sampled_from(NAMES))
    keys = fields_of(name)
    fields = data.draw(st.fixed_dictionaries({}, optional={k: JSON for k in keys}))
    text = json.dumps({"v": SCHEMA, "type": name, "fields": fields, "tensors": []})  # NaN/Infinity as JSON allows
    decodes_or_refuses([text.encode()])


# -- 3: mutations of valid messages -----------------------------------------------------------------

NASTY = [
    "9" * 5000,
    "-" + "9" * 5000,
    "1" + "0" * 400,
    "[" * 10000 + "]" * 10000,
    '{"a":' * 3000 + "1" + "}" * 3000,
    "[" * 15 + "]" * 15,
    "1e300",
    "-1e300",
    "1e999",
    "NaN",
    "Infinity",
    "-Infinity",
    "-0.0",
    "4.5",
    "-1",
    "0",
    "1",
    "65535",
    "65536",
    str(2**53),
    str(2**53 + 1),
    str(2**63 - 1),
    str(2**63),
    "true",
    "false",
    "null",
    '""',
    '"values"',
    '"float32"',
    '"x"',
    '"' + "x" * 70_000 + '"',
    '"\\ud800"',
    "[]",
    "{}",
    "[1]",
    "[-1]",
    '["w",[2,3]]',
    "[" + ",".join(["0"] * 70_000) + "]",
    '{"a":1}',
    '{"0":1}',
    '[{"lr":0.1}]',
]
ENCODED = [(type(m).__name__, [bytes(memoryview(f)) for f in encode(m)]) for m in MESSAGES]
SPLICE = '"@NASTY@"'


def splice(header: dict, value: str) -> bytes:
    return json.dumps(header, separators=(",", ":")).replace(SPLICE, value, 1).encode()


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(ENCODED), st.data())
def test_mutated_messages(sample, data):
    name, frames = sample
    header = json.loads(frames[0])
    tensors = list(frames[1:])
    nasty = data.draw(st.sampled_from(NASTY), label="value")
    where = data.draw(st.sampled_from(["field", "drop field", "extra field", "envelope", "spec", "frame"]))
    if where == "field" and header["fields"]:
        key = data.draw(st.sampled_from(sorted(header["fields"])))
        header["fields"][key] = SPLICE[1:-1]
    elif where == "drop field" and header["fields"]:
        del header["fields"][data.draw(st.sampled_from(sorted(header["fields"])))]
    elif where == "extra field":
        header["fields"][data.draw(st.sampled_from(["x", "values", "tensors", "v"]))] = SPLICE[1:-1]
    elif where == "envelope":
        header[data.draw(st.sampled_from(["v", "type", "fields", "tensors", "extra"]))] = SPLICE[1:-1]
    elif where == "spec" and header["tensors"]:
        i = data.draw(st.integers(0, len(header["tensors"]) - 1))
        j = data.draw(st.integers(0, 3))
        spec = header["tensors"][i]
        if j == 3 and spec[3] and data.draw(st.booleans()):
            spec[3][data.draw(st.integers(0, len(spec[3]) - 1))] = SPLICE[1:-1]  # one dimension
        else:
            spec[j] = SPLICE[1:-1]
    elif where == "frame":
        how = data.draw(st.sampled_from(["drop", "extra", "truncate", "grow", "empty"]))
        i = data.draw(st.integers(0, len(tensors))) if tensors else 0
        if how == "extra" or not tensors:
            tensors.insert(i, b"\x00" * data.draw(st.integers(0, 64)))
        elif how == "drop":
            tensors.pop(min(i, len(tensors) - 1))
        else:
            k = min(i, len(tensors) - 1)
            tensors[k] = {"truncate": tensors[k][:-1], "grow": tensors[k] + b"\x00" * 4, "empty": b""}[how]
    decodes_or_refuses([splice(header, nasty), *tensors])


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(ENCODED), st.data())
def test_mutated_shapes_and_dtypes_against_their_frames(sample, data):
    """A shape or dtype that does not fit the frame is refused before a byte is copied."""
    name, frames = sample
    header = json.loads(frames[0])
    if not header["tensors"]:
        return
    spec = header["tensors"][data.draw(st.integers(0, len(header["tensors"]) - 1))]
    spec[2] = data.draw(st.sampled_from(["float32", "bfloat16", "float16", "int64", "int32", "uint8", "int8", "bool"]))
    spec[3] = data.draw(st.lists(st.integers(0, 2**32), max_size=10))
    decodes_or_refuses([json.dumps(header).encode(), *frames[1:]])


# -- 4: every message type still round-trips -----------------------------------------------------


def test_every_message_type_round_trips():
    from ddiloco.service.base.wire import MESSAGES as WIRE_MESSAGES

    assert {type(m).__name__ for m in MESSAGES} == set(WIRE_MESSAGES)
    for msg in MESSAGES:
        out = decode([bytes(memoryview(f)) for f in encode(msg)])
        assert type(out) is type(msg)
        for f in vars(msg):
            assert same(getattr(msg, f), getattr(out, f)), f
