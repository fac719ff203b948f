"""The wire format: every message round-trips bit for bit; anything malformed is a WireError."""

import json

import pytest
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
from ddiloco.service.wire import SCHEMA, WireError, decode, encode


def contribution(values, **kw):
    fields = dict(
        learner=1,
        incarnation=5,
        fragment=2,
        base_version=3,
        seq=11,
        values=values,
        steps=4,
        tokens=100,
        data_position=7,
        step=9,
    )
    return Contribution(**{**fields, **kw})


MESSAGES = [
    Heartbeat(1, 5, 20, 0.125),
    contribution([torch.randn(3, 4), torch.randn(5)]),
    contribution([torch.randn(2)], kind="delta"),
    Ack(1, 5, 2, 3),
    FragmentRequest(1, 2, 17),
    FragmentUpdate(1, 2, 5, [torch.randn(2, 2)], 1234.0, 3, 99, "join"),
    Register(1, 5, [["w", [2, 3]], ["b", [3]]], "abc123", [0, 4], 1234, "cuda:0"),
    JoinReply(False, "model does not match", 15, 10, [0, 2]),
    Leave(3, 5),
    SyncerHeartbeat(12, 1),
    PeerStateRequest(2, 5),
    PeerState(
        2,
        0,
        [{"lr": 0.001, "params": [0, 1], "betas": [0.9, 0.95]}],
        {"0.exp_avg": torch.randn(3), "0.step": torch.tensor(5.0), "1.bf": torch.randn(2).bfloat16()},
    ),
    FetchGlobal("evaluator"),
    GlobalState({"0": 3}, 10.0, {"0.0": torch.randn(4)}),
]


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("msg", MESSAGES, ids=[type(m).__name__ for m in MESSAGES])
def test_round_trip(msg):
    frames = [bytes(memoryview(f)) for f in encode(msg)]
    out = decode(frames)
    assert type(out) is type(msg)
    for f in vars(msg):
        assert same(getattr(msg, f), getattr(out, f)), f


def header(**kw):
    h = {
        "v": SCHEMA,
        "type": "Heartbeat",
        "fields": {"learner": 1, "incarnation": 1, "step": 2, "step_time_s": 0.1},
        "tensors": [],
    }
    h.update(kw)
    return json.dumps(h).encode()


GOOD = encode(contribution([torch.zeros(2, 2)]))
BAD = [
    ("empty", []),
    ("not JSON", [b"\xff\xfe"]),
    ("schema", [header(v=SCHEMA + 1)]),
    ("unknown type", [header(type="Exec")]),
    ("field type", [header(fields={"learner": "one", "incarnation": 1, "step": 2, "step_time_s": 0.1})]),
    ("missing field", [header(fields={"learner": 1})]),
    ("unknown field", [header(fields={"learner": 1, "incarnation": 1, "step": 2, "step_time_s": 0.1, "x": 1})]),
    (
        "non-finite",
        [
            header(fields={"learner": 1, "incarnation": 1, "step": 2, "step_time_s": float("inf")}).replace(
                b"Infinity", b"1e999"
            )
        ],
    ),
    ("missing frames", [bytes(GOOD[0])]),
    ("extra frames", [bytes(GOOD[0]), bytes(memoryview(GOOD[1])), b"x"]),
    ("byte size", [bytes(GOOD[0]), b"\x00" * 15]),
    ("dtype", [bytes(GOOD[0]).replace(b"float32", b"object"), bytes(memoryview(GOOD[1]))]),
    ("literal", [bytes(GOOD[0]).replace(b'"kind":"values"', b'"kind":"pickle"'), bytes(memoryview(GOOD[1]))]),
    ("bool as int", [header(fields={"learner": True, "incarnation": 1, "step": 2, "step_time_s": 0.1})]),
]


@pytest.mark.parametrize("what,frames", BAD, ids=[b[0] for b in BAD])
def test_malformed_messages_raise_wire_error(what, frames):
    with pytest.raises(WireError):
        decode(frames)
