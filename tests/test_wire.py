"""The wire format: every message round-trips bit for bit; anything malformed is a WireError."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from ddiloco.core import compress
from ddiloco.core.compress import Encoded
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
from ddiloco.service.base.wire import MAX_HEADER, SCHEMA, WireError, decode, encode, largest_piece, max_frame_bytes


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


def _pieces(encoding: str) -> tuple[list[torch.Tensor], list[Encoded]]:
    """A fragment of a parameter (in ``encoding``; 130 values: two blocks, odd) and a buffer (exact)."""
    encoded = [compress.encode(torch.randn(10, 13), encoding), compress.encode(torch.randn(3), "fp32")]
    return [compress.decode(e) for e in encoded], encoded


def _sparse_pieces(encoding: str) -> tuple[list[torch.Tensor], list[Encoded]]:
    """A parameter of one whole top-k chunk and a shorter one (4,480 values), and a buffer."""
    encoded = [compress.encode(torch.randn(70, 64), encoding), compress.encode(torch.randn(3), "fp32")]
    return [compress.decode(e) for e in encoded], encoded


def compressed(encoding: str) -> Contribution:
    values, encoded = (_sparse_pieces if "+" in encoding else _pieces)(encoding)
    return contribution(values, kind="delta", encoded=encoded)


def compressed_update(encoding: str) -> FragmentUpdate:
    values, encoded = (_sparse_pieces if "+" in encoding else _pieces)(encoding)
    return FragmentUpdate(1, 2, 6, values, 1300.0, 3, kind="delta", base_version=5, encoded=encoded)


MESSAGES = [
    Heartbeat(1, 5, 20, 0.125),
    Heartbeat(1, 5, 20, 0.125, tokens=4096, busy_s=12.5, loss=2.75, bytes_sent=1_000_000),
    contribution([torch.randn(3, 4), torch.randn(5)]),
    contribution([torch.randn(2)], kind="delta"),
    *[compressed(enc) for enc in ("bf16", "int8", "int4", "int2", "int2+top41", "fp32+top123")],
    Ack(1, 5, 2, 3),
    FragmentRequest(1, 2, 17),
    FragmentUpdate(1, 2, 5, [torch.randn(2, 2)], 1234.0, 3, 99, "join"),
    compressed_update("int4"),
    compressed_update("int4+top41"),
    Register(1, 5, [["w", [2, 3]], ["b", [3]]], "abc123", [0, 4], 1234, "cuda:0"),
    Register(1, 5, [["w", [2]]], "abc", [], 1, "cpu", {"run.processed_tokens": 10**6, "algo.num_fragments": "auto"}),
    JoinReply(False, "model does not match", 15, 10, [0, 2]),
    JoinReply(False, "learner 1 was superseded", 15, 0, [0], superseded=True),
    JoinReply(True, "", 15, 3, [0, 1], run="9f2c4e1a7b3d5f60"),
    Register(2, 6, [["w", [2]]], "abc", [3, 4], 1, "cpu", {}, "9f2c4e1a7b3d5f60"),
    SettingsRequest(3, 7),
    RunSettings({"run.processed_tokens": 600_000, "algo.alpha": 0.5, "algo.fragment_strategy": "balanced"}),
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
    FetchGlobal("evaluator", held={"0": 3, "2": 0, "4": 2**53}),
    FetchGlobal("evaluate hook", versions_only=True),
    GlobalState({"0": 3}, 10.0, {"0.0": torch.randn(4)}),
    GlobalState({"1": 5}, 12.0, {"1.0": torch.randn(2)}, run_ended=True),
    GlobalState({"0": 3, "2": 7}, 12.0, {"2.0": torch.randn(2), "2.1": torch.randn(3)}, tokens_per_step=1024.0),
    GlobalState({"0": 3, "2": 7}, 12.0, {}, tokens_per_step=0.5),
    RunEnd("stop", "600,000 global tokens merged"),
    RunEnd("done", ""),
    StatusRequest("ddiloco status"),
    StatusReply({"shard": 0, "learners": [{"learner": 1, "state": "up", "loss": None, "steps_per_s": 2.5}]}),
]


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, Encoded):
        scales = a.scales is None and b.scales is None or same(a.scales, b.scales)
        return (a.encoding, a.shape) == (b.encoding, b.shape) and same(a.data, b.data) and scales
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


# -- issue 8: every input bounded, every decode total ------------------------------------------


def raw_header(kind: str, fields: dict, tensors: list | None = None, **raw: str) -> bytes:
    """A header whose field values in ``raw`` are spliced in as JSON text (json.dumps refuses 10**5000)."""
    text = json.dumps(
        {"v": SCHEMA, "type": kind, "fields": {**fields, **{k: f"@{k}@" for k in raw}}, "tensors": tensors or []}
    )
    for k, v in raw.items():
        text = text.replace(f'"@{k}@"', v)
    return text.encode()


HB = {"learner": 1, "incarnation": 1, "step": 2, "step_time_s": 0.1}
GIB_SHAPE = [1 << 15, 1 << 15]  # 2**30 float32 elements announced
FINDINGS = [
    ("5000-digit integer", [raw_header("Heartbeat", HB, step="9" * 5000)], "digits"),
    ("5000-digit integer in a string-free list", [raw_header("Heartbeat", HB, step="[" + "1" * 5000 + "]")], "digits"),
    ("deep nesting", [raw_header("Heartbeat", HB, step="[" * 10000 + "]" * 10000)], "nested"),
    ("deep nesting, unterminated", [b"[" * 100000], "nested"),
    ("deep nesting of objects", [raw_header("Heartbeat", HB, step='{"a":' * 5000 + "1" + "}" * 5000)], "nested"),
    ("counter 10**400", [raw_header("Heartbeat", HB, step="1" + "0" * 400)], "digits"),
    ("counter just past 2**53", [header(fields={**HB, "step": 2**53 + 1})], "Heartbeat.step"),
    ("incarnation past 2**63", [header(fields={**HB, "incarnation": 2**63})], "Heartbeat.incarnation"),
    ("learner id past 65535", [header(fields={**HB, "learner": 65536})], "Heartbeat.learner"),
    ("negative learner id", [header(fields={**HB, "learner": -1})], "Heartbeat.learner"),
    ("step_time 1e300", [header(fields={**HB, "step_time_s": 1e300})], "Heartbeat.step_time_s"),
    ("step_time -1", [header(fields={**HB, "step_time_s": -1})], "Heartbeat.step_time_s"),
    ("step_time 1e999 (inf)", [raw_header("Heartbeat", HB, step_time_s="1e999")], "Heartbeat.step_time_s"),
    ("step_time NaN", [raw_header("Heartbeat", HB, step_time_s="NaN")], "NaN"),
    ("step_time as a 400-digit integer", [raw_header("Heartbeat", HB, step_time_s="9" * 400)], "digits"),
    ("bool as int", [header(fields={**HB, "step": True})], "Heartbeat.step"),
    (
        "int as bool",
        [raw_header("JoinReply", {"reason": "", "epoch": 1, "data_position": 0, "owned": []}, accepted="1")],
        "accepted",
    ),
    (
        "1 GiB shape with a small frame",
        [bytes(GOOD[0]).replace(b"[2,2]", json.dumps(GIB_SHAPE).replace(" ", "").encode()), b"\x00" * 16],
        "bytes",
    ),
    ("9-dimensional tensor", [bytes(GOOD[0]).replace(b"[2,2]", b"[1,1,1,1,1,1,1,2,2]"), b"\x00" * 16], "shape"),
    ("dimension past 2**31", [bytes(GOOD[0]).replace(b"[2,2]", b"[2147483649,0]"), b""], "shape"),
    ("too many frames", [bytes(GOOD[0])] + [b""] * 100_001, "frames"),
    ("unhashable type", [header(type=["Heartbeat"])], "type"),
    ("unhashable dtype", [bytes(GOOD[0]).replace(b'"float32"', b'["float32"]'), bytes(memoryview(GOOD[1]))], "dtype"),
    (
        "unhashable tensor field",
        [bytes(GOOD[0]).replace(b'["values",', b'[["values"],'), bytes(memoryview(GOOD[1]))],
        "field",
    ),
    (
        "tensor index as bool",
        [bytes(GOOD[0]).replace(b'"values",0', b'"values",false'), bytes(memoryview(GOOD[1]))],
        "index",
    ),
    ("lone surrogate", [header(type="FetchGlobal", fields={"requester": "\ud800"})], "Unicode"),
    ("long string", [header(type="FetchGlobal", fields={"requester": "x" * 257})], "FetchGlobal.requester"),
    ("extra header key", [header(extra=1)], "header keys"),
    ("frame that is not a buffer", [None], "buffer"),
    ("frames that are not a list", b"frames", "list"),
    ("header that is not an object", [b"[1, 2]"], "object"),
    (
        "register: a 9-dim parameter",
        [header(type="Register", fields={"learner": 1, "incarnation": 1, "layout": "x", "params": [["w", [1] * 9]]})],
        "Register.params[0]",
    ),
    (
        "register: a name that is not a string",
        [header(type="Register", fields={"learner": 1, "incarnation": 1, "layout": "x", "params": [[1, [1]]]})],
        "Register.params[0]",
    ),
    (
        "register: a name with a lone surrogate",
        [
            header(
                type="Register",
                fields={"learner": 1, "incarnation": 1, "layout": "x", "params": [["\ud800", [1]]]},
            )
        ],
        "Unicode",
    ),
    (
        "peer state: NaN in param_groups",
        [raw_header("PeerState", {"learner": 1, "source": 2, "tensors": {}}, param_groups='[{"lr": NaN}]')],
        "NaN",
    ),
    (
        "peer state: huge int in param_groups",
        [header(type="PeerState", fields={"learner": 1, "source": 2, "param_groups": [{"lr": 2**64}]})],
        "param_groups",
    ),
    (
        "peer state: source -2",
        [header(type="PeerState", fields={"learner": 1, "source": -2, "param_groups": []})],
        "PeerState.source",
    ),
    (
        "global state: 10**30 tokens",
        [header(type="GlobalState", fields={"versions": {}, "merged_tokens": 1e30})],
        "merged_tokens",
    ),
    (
        "fragment update: zero live learners",
        [
            header(
                type="FragmentUpdate",
                fields={"learner": 1, "fragment": 0, "version": 1, "merged_tokens": 0.0, "live_learners": 0},
            )
        ],
        "live_learners",
    ),
]


@pytest.mark.parametrize("what,frames,says", FINDINGS, ids=[f[0] for f in FINDINGS])
def test_review_findings_are_wire_errors(what, frames, says):
    with pytest.raises(WireError) as info:
        decode(frames)
    assert says in str(info.value), str(info.value)
    assert not str(info.value).startswith("decode bug"), str(info.value)
    assert len(str(info.value)) < 500  # one readable line, never the offending 1 MiB


def test_the_error_names_field_value_and_range():
    with pytest.raises(
        WireError, match=r"Heartbeat\.step_time_s: 1e\+300 is not a finite number in \[0\.0, 86400\.0\]"
    ):
        decode([header(fields={**HB, "step_time_s": 1e300})])
    with pytest.raises(
        WireError, match=r"Heartbeat\.step: 9007199254740993 is not an integer in \[0, 9007199254740992\]"
    ):
        decode([header(fields={**HB, "step": 2**53 + 1})])


def test_every_numeric_field_of_every_message_declares_its_bounds():
    from ddiloco.service.base.wire import MESSAGES as WIRE_MESSAGES
    from ddiloco.service.base.wire import _plan

    for cls in WIRE_MESSAGES.values():
        _plan(cls)  # raises TypeError for a numeric field without min/max
        for fl in dataclasses.fields(cls):
            if fl.type in ("int", "float"):
                assert {"min", "max"} <= set(fl.metadata), f"{cls.__name__}.{fl.name}"


def test_values_at_the_bounds_round_trip():
    for msg in [
        Heartbeat(65535, 2**63 - 1, 2**53, 86400.0, 2**53, 1e10, 1e30, 2**53),
        Heartbeat(0, 0, 0, 0.0, 0, 0.0, -1.0, 0),
        FragmentUpdate(65535, 65535, 2**53, [], 1e18, 65536, 2**53, "stale"),
        PeerState(0, -1, [], {}),
        JoinReply(True, "", 2**63 - 1, 2**53, list(range(0, 65536, 1000))),
        SyncerHeartbeat(0, 1023),
    ]:
        assert decode(encode(msg)) == msg


@pytest.mark.parametrize(
    "msg",
    [
        Heartbeat(1, 5, 20, -1.0),
        Heartbeat(1, 5, 20, float("nan")),
        Heartbeat(1, 5, 20, 1e300),
        Heartbeat(70000, 5, 20, 0.1),
        Heartbeat(True, 5, 20, 0.1),
        Heartbeat(1, 5, 10**400, 0.1),
        contribution([torch.zeros(2)], tokens=-1),
        contribution([torch.zeros(2)], kind="pickle"),
        contribution([torch.zeros([1] * 9)]),
        Register(1, 5, [["w", [2, 3, -1]]], "abc"),
        Register(1, 5, [["w" * 2000, [2]]], "abc"),
        Register(1, 5, [], "abc", settings={"run.seed": [1]}),  # type: ignore[dict-item]
        RunSettings({f"k{i}": i for i in range(65)}),
        RunSettings({"inner.lr": float("nan")}),
        RunSettings({"run.processed_tokens": 2**64}),
        RunSettings({"run.seed": [1]}),
        SettingsRequest(70000, 1),
        JoinReply(1, "", 1, 0, []),
        PeerState(1, 2, [{"lr": float("inf")}], {}),
        PeerState(1, 2, [{"nested": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}], {}),
        GlobalState({"0": -1}, 0.0, {}),
        GlobalState({"0": 1}, 0.0, {}, tokens_per_step=-1.0),
        GlobalState({"0": 1}, 0.0, {}, tokens_per_step=float("inf")),
        FetchGlobal("evaluator", held={"0": -1}),
        FetchGlobal("evaluator", held={str(i): 0 for i in range(65537)}),
        FragmentUpdate(1, 2, 5, [], 1.0, 0),
    ],
    ids=lambda m: type(m).__name__,
)
def test_encode_refuses_what_decode_would_refuse(msg):
    with pytest.raises(ValueError, match="refusing to encode"):
        encode(msg)


def test_encode_refuses_unsupported_things():
    with pytest.raises(TypeError):
        encode(contribution([torch.zeros(2, dtype=torch.float64)]))
    with pytest.raises(TypeError):
        encode(object())


def test_a_real_optimizer_state_round_trips():
    from ddiloco.training.peer_state import state_message

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    msg = state_message(opt, 2, 1)
    out = decode([bytes(memoryview(f)) for f in encode(msg)])
    assert out.param_groups == json.loads(json.dumps(msg.param_groups))  # tuples become lists
    assert same(msg.tensors, out.tensors)


def test_max_frame_bytes():
    assert max_frame_bytes(0) == MAX_HEADER  # the header frame is the floor
    assert max_frame_bytes(10**9) == 8 * 10**9  # int64 is the widest dtype on the wire
    assert max_frame_bytes(10**9, itemsize=4) == 4 * 10**9
    model = torch.nn.Embedding(50_000, 512)
    largest = max(p.numel() for p in model.parameters())
    frames = encode(contribution([model.weight.detach()]))
    assert max(memoryview(f).nbytes for f in frames) <= max_frame_bytes(largest)
    with pytest.raises(ValueError):
        max_frame_bytes(-1)


@pytest.mark.parametrize("msg", MESSAGES, ids=[type(m).__name__ for m in MESSAGES])
def test_decode_takes_encoded_frames_as_they_are(msg):
    """The in-process transport hands over encode's own buffers (ndarrays, 0-d ones included)."""
    out = decode(encode(msg))
    for f in vars(msg):
        assert same(getattr(msg, f), getattr(out, f)), f


def test_a_non_contiguous_frame_is_a_wire_error():
    frames = encode(contribution([torch.zeros(2, 2)]))
    with pytest.raises(WireError, match="contiguous"):
        decode([frames[0], torch.zeros(2, 4).numpy()[:, ::2]])


# -- compressed payloads: checked before they are decoded -------------------------------------------


def _frames(msg) -> list[bytes]:
    return [bytes(memoryview(f)) for f in encode(msg)]


@pytest.mark.parametrize("encoding", ["int8", "int4", "int2", "int2+top41", "bf16+top7"])
def test_compressed_payloads_travel_as_their_codes(encoding):
    msg = compressed(encoding)
    frames = _frames(msg)
    assert [len(f) for f in frames[1:]] == [e.nbytes for e in msg.encoded]  # codes and scales only
    out = decode(frames)
    assert out.kind == "delta" and all(torch.equal(a, b) for a, b in zip(out.values, msg.values))


@pytest.mark.parametrize(
    "forge,reason",
    [
        (lambda f: np.float32(np.nan).tobytes() + f[4:], "not finite"),
        (lambda f: np.float32(np.inf).tobytes() + f[4:], "not finite"),
        (lambda f: np.float32(1e30).tobytes() + f[4:], "outside"),
        (lambda f: np.float32(-1.0).tobytes() + f[4:], "outside"),
        (lambda f: f[:-1], "expected"),
        (lambda f: f + b"\x00", "expected"),
        (lambda f: f[:4], "expected"),  # a block's scale and no codes: a truncated payload
        (lambda f: f[:8] + bytes([0x00]) + f[9:], "range"),  # a stored nibble of 0: code -8
    ],
    ids=["nan-scale", "inf-scale", "huge-scale", "negative-scale", "truncated", "padded", "codes-missing", "code"],
)
def test_hostile_compressed_payloads_are_refused_with_a_reason(forge, reason):
    frames = _frames(compressed("int4"))
    frames[1] = forge(frames[1])
    with pytest.raises(WireError, match=reason):
        decode(frames)


def test_a_wrong_block_count_or_encoding_is_refused():
    frames = _frames(compressed("int4"))
    header = json.loads(frames[0])
    header["tensors"][0][3] = [10, 14]  # the shape claims 140 values: 2 blocks still, more codes
    with pytest.raises(WireError, match="expected"):
        decode([json.dumps(header).encode(), *frames[1:]])
    header["tensors"][0][2] = "int3"
    with pytest.raises(WireError, match="unsupported encoding"):
        decode([json.dumps(header).encode(), *frames[1:]])


def _positions_frame(frame: bytes, encoding: str, numel: int, positions: list[int]) -> bytes:
    """``frame`` (one sparse piece) with its packed positions replaced by ``positions``."""
    n_scales, n_data, n_positions = compress.frame_nbytes(numel, encoding)
    packed = compress._pack12(torch.tensor(positions)).numpy().tobytes()
    assert len(packed) == n_positions
    return frame[: n_scales + n_data] + packed


@pytest.mark.parametrize(
    "mutate,reason",
    [
        (lambda p: [p[1], p[0], *p[2:]], "not increasing"),  # unsorted in the first chunk
        (lambda p: [p[0], p[0], *p[2:]], "not increasing"),  # a position twice
        (lambda p: [*p[:-1], 4095], "outside its chunk"),  # the last chunk holds 384 values
        (lambda p: [*p[:-1], 384], "outside its chunk"),
    ],
    ids=["unsorted", "repeated", "beyond-the-tail", "tail-edge"],
)
def test_hostile_sparse_positions_are_refused_with_a_reason(mutate, reason):
    msg = compressed("int4+top41")
    frames = _frames(msg)
    e = msg.encoded[0]
    local = compress._unpack12(e.indices)[: compress.kept(e.numel, e.encoding)].tolist()
    frames[1] = _positions_frame(frames[1], e.encoding, e.numel, mutate(local))
    with pytest.raises(WireError, match=reason):
        decode(frames)


def test_sparse_positions_padding_and_names_are_checked():
    msg = compressed("int4+top41")
    frames = _frames(msg)
    header = json.loads(frames[0])
    for bad in ("int4+top0", "int4+top4096", "int4+top041", "int4+top-1", "int3+top41", "int4+top٤١", "int4+top"):
        header["tensors"][0][2] = bad
        with pytest.raises(WireError, match="unsupported encoding"):
            decode([json.dumps(header).encode(), *frames[1:]])
    t = torch.randn(4097)
    e = compress.encode(t, "int8+top40")  # 40 + 1 kept: an odd count, its last pair padded
    assert compress.check(e) is None
    n = compress.kept(e.numel, e.encoding)
    assert n == 41 and e.indices is not None and e.indices.numel() == 63
    forged = e.indices.clone()
    forged[-1] |= 0x10  # the padding position's high bits
    assert "padding" in str(compress.check(dataclasses.replace(e, indices=forged)))


def test_values_and_their_codes_together_are_refused():
    msg = compressed("int8")
    frames = _frames(msg)
    header = json.loads(frames[0])
    extra = _frames(contribution([torch.randn(10, 13), torch.randn(3)]))
    spec = json.loads(extra[0])["tensors"]
    header["tensors"] += spec
    with pytest.raises(WireError, match="both values and encoded"):
        decode([json.dumps(header).encode(), *frames[1:], *extra[1:]])


def test_a_sparse_piece_that_would_decode_past_the_receivers_largest_piece_is_refused_before_decoding():
    """A sparse frame is ~1/9,000 of what it decodes to: the receiver bounds the values (its
    layout's largest piece), not only the frame's bytes."""
    numel = 1 << 24  # 64 MiB as float32, from a frame of ~7 KiB
    e = compress.encode(torch.zeros(numel), "int2+top1")
    msg = contribution([compress.decode(e)], kind="delta", encoded=[e])
    frames = _frames(msg)
    assert len(frames[1]) < 8_000
    with pytest.raises(WireError, match="more than this model's largest piece"):
        decode(frames, max_numel=numel - 1)
    assert decode(frames, max_numel=numel).values[0].shape == (numel,)  # within the bound: decoded


def test_both_receivers_bound_a_sparse_piece_by_their_layouts_largest_piece():
    """The syncer and a learner's comm thread pass ``largest_piece(layout)`` to ``decode``: a
    version's piece that decodes past it is refused like a contribution's."""
    from ddiloco.core.fragments import TensorSpec, balanced_layout

    layout = balanced_layout([TensorSpec("w", (300, 40)), TensorSpec("b", (40,)), TensorSpec("e", (7, 3))], 4)
    biggest = max(pc.numel for frag in layout.fragments for pc in frag)
    assert largest_piece(layout) == biggest <= 300 * 40
    e = compress.encode(torch.zeros(biggest + 1), "int2+top1")
    update = FragmentUpdate(learner=1, fragment=0, version=3, values=[compress.decode(e)], merged_tokens=10.0,
                            live_learners=2, kind="delta", base_version=2, encoded=[e])  # fmt: skip
    frames = _frames(update)
    with pytest.raises(WireError, match="more than this model's largest piece"):
        decode(frames, max_numel=largest_piece(layout))


def test_an_empty_sparse_piece_travels_and_long_encoding_names_are_refused():
    msg = compressed("int2+top41")
    empty = compress.encode(torch.zeros(0), "int2+top41")
    msg = dataclasses.replace(msg, values=[*msg.values, torch.zeros(0)], encoded=[*msg.encoded, empty])
    out = decode(_frames(msg))
    assert out.values[-1].numel() == 0
    frames = _frames(compressed("int4+top41"))
    header = json.loads(frames[0])
    header["tensors"][0][2] = "int4+top" + "4" * 5000  # past Python's int() digit limit
    with pytest.raises(WireError, match="unsupported encoding"):
        decode([json.dumps(header).encode(), *frames[1:]])
    assert compress.parse("int4+top" + "1" * 5000) is None
