"""Wire encodings: error bounds, edge cases and sizes."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.core.compress import (
    BLOCK_SIZE,
    CHUNK,
    DATA_DTYPE,
    ENCODINGS,
    Encoded,
    check,
    decode,
    density,
    encode,
    encoded_nbytes,
    frame_nbytes,
    index_nbytes,
    kept,
    parse,
    positions,
    sparse,
)
from ddiloco.errors import ConfigError

torch.set_num_threads(1)


def _sample(numel: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Mixed magnitudes across blocks so the per-block scales matter.
    return torch.randn(numel, generator=g) * torch.logspace(-4, 2, numel)


def _blockwise_absmax(t: torch.Tensor) -> torch.Tensor:
    """Per-value absmax of the block the value belongs to."""
    flat = t.reshape(-1)
    pad = -flat.numel() % BLOCK_SIZE
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK_SIZE)
    return blocks.abs().amax(1).repeat_interleave(BLOCK_SIZE)[: flat.numel()]


@pytest.mark.parametrize("shape", [(1000,), (7, 13), (BLOCK_SIZE,), (3, BLOCK_SIZE + 1), (1,), ()])
def test_fp32_is_exact(shape: tuple[int, ...]) -> None:
    t = _sample(math.prod(shape)).reshape(shape)
    assert torch.equal(decode(encode(t, "fp32")), t)


@pytest.mark.parametrize("shape", [(1000,), (7, 13), (3, BLOCK_SIZE + 1)])
def test_bf16_relative_error(shape: tuple[int, ...]) -> None:
    t = _sample(math.prod(shape)).reshape(shape)
    out = decode(encode(t, "bf16"))
    assert out.shape == t.shape and out.dtype == torch.float32
    assert ((out - t).abs() <= t.abs() * 2.0**-8).all()


@pytest.mark.parametrize("encoding,qmax", [("int8", 127), ("int4", 7), ("int2", 1)])
@pytest.mark.parametrize("shape", [(1000,), (7, 13), (BLOCK_SIZE,), (3, BLOCK_SIZE + 1), (1,), (5,), (6,), (7,), ()])
def test_int_blockwise_error_bound(encoding: str, qmax: int, shape: tuple[int, ...]) -> None:
    t = _sample(math.prod(shape), seed=len(shape)).reshape(shape)
    out = decode(encode(t, encoding))
    assert out.shape == t.shape and out.dtype == torch.float32
    bound = _blockwise_absmax(t) / qmax / 2
    err = (out - t).abs().reshape(-1)
    assert (err <= bound * (1 + 1e-5) + 1e-12).all()
    # The block maximum is represented exactly (up to float rounding).
    i = t.reshape(-1).abs().argmax()
    assert torch.isclose(out.reshape(-1)[i], t.reshape(-1)[i], rtol=1e-6)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_zero_and_mixed_zero_blocks(encoding: str) -> None:
    z = torch.zeros(3, 100)
    assert torch.equal(decode(encode(z, encoding)), z)
    t = torch.cat([torch.zeros(BLOCK_SIZE), torch.ones(BLOCK_SIZE + 3)])  # one all-zero block
    assert torch.equal(decode(encode(t, encoding)), t)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_other_dtypes_and_empty(encoding: str) -> None:
    t = torch.linspace(-1, 1, 301, dtype=torch.float64).to(torch.bfloat16)
    e = encode(t, encoding)
    assert e.dtype == torch.bfloat16 and e.shape == (301,)
    assert decode(e).dtype == torch.float32
    empty = torch.empty(0, 4)
    assert decode(encode(empty, encoding)).shape == (0, 4)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_non_finite_stays_non_finite(encoding: str) -> None:
    for bad in (float("nan"), float("inf")):
        t = torch.ones(300)
        t[5] = bad
        out = decode(encode(t, encoding))
        assert not torch.isfinite(out[5])
        assert torch.isfinite(out[BLOCK_SIZE * 2 :]).all()  # other blocks unaffected


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("numel", [0, 1, 2, 127, 128, 129, 1000, 65537])
def test_nbytes_matches_cost_model(encoding: str, numel: int) -> None:
    assert encode(torch.ones(numel), encoding).nbytes == encoded_nbytes(numel, encoding)


def test_nbytes_ratios() -> None:
    n = 1 << 20
    fp32 = encoded_nbytes(n, "fp32")
    assert fp32 / encoded_nbytes(n, "bf16") == 2
    assert 3.8 < fp32 / encoded_nbytes(n, "int8") <= 4
    assert 7.5 < fp32 / encoded_nbytes(n, "int4") <= 8


def test_encode_is_a_snapshot() -> None:
    t = torch.ones(10)
    e = encode(t, "fp32")
    t.add_(1)
    assert torch.equal(decode(e), torch.ones(10))


def test_unknown_encoding() -> None:
    with pytest.raises(ConfigError, match="allowed: fp32, bf16, int8, int4"):
        encode(torch.ones(3), "fp8")
    with pytest.raises(ConfigError, match="unknown encoding"):
        encoded_nbytes(3, "int3")


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=0, max_size=300),
    encoding=st.sampled_from(["int8", "int4", "int2"]),
)
def test_int_bound_property(values: list[float], encoding: str) -> None:
    t = torch.tensor(values, dtype=torch.float32)
    out = decode(encode(t, encoding))
    qmax = {"int8": 127, "int4": 7, "int2": 1}[encoding]
    bound = _blockwise_absmax(t) / qmax / 2
    assert ((out - t).abs() <= bound * (1 + 1e-5) + 1e-30).all()


# -- what a receiver checks before decoding a payload from the network ------------------------


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("numel", [0, 1, 5, BLOCK_SIZE, 1000])
def test_honest_payloads_pass_the_check(encoding: str, numel: int) -> None:
    assert check(encode(_sample(numel), encoding)) is None


def _forged(e: Encoded, **changes: object) -> Encoded:
    return dataclasses.replace(e, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("encoding", ["int8", "int4", "int2"])
def test_hostile_scales_are_refused(encoding: str) -> None:
    e = encode(_sample(300), encoding)
    assert e.scales is not None
    for bad, reason in [(math.nan, "not finite"), (math.inf, "not finite"), (-1.0, "outside"), (1e30, "outside")]:
        scales = e.scales.clone()
        scales[1] = bad
        assert reason in (check(_forged(e, scales=scales)) or "")
    assert "blocks" in (check(_forged(e, scales=e.scales[:-1])) or "")  # a wrong block count
    assert "scales" in (check(_forged(e, scales=None)) or "")


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_truncated_or_padded_codes_are_refused(encoding: str) -> None:
    e = encode(_sample(300), encoding)
    assert "expected" in (check(_forged(e, data=e.data[:-1])) or "")
    assert "expected" in (check(_forged(e, data=torch.cat([e.data, e.data[:1]]))) or "")
    wrong = e.data.view(torch.uint8) if encoding == "int8" else e.data.to(torch.float64)
    assert check(_forged(e, data=wrong)) is not None


def test_codes_out_of_range_are_refused() -> None:
    e8 = encode(_sample(10), "int8")
    data = e8.data.clone()
    data[3] = -128
    assert "-128" in (check(_forged(e8, data=data)) or "")
    e4 = encode(_sample(10), "int4")
    data = e4.data.clone()
    data[0] = data[0] & 0xF0  # a stored nibble of 0 is code -8, outside [-7, 7]
    assert "range" in (check(_forged(e4, data=data)) or "")
    e4 = encode(_sample(9), "int4")  # the last byte's high nibble is padding, which must be 0
    data = e4.data.clone()
    data[-1] = data[-1] | 0x30
    assert "padding" in (check(_forged(e4, data=data)) or "")
    e2 = encode(_sample(8), "int2")
    data = e2.data.clone()
    data[0] = data[0] | 0x03  # a stored 3 is code 2, outside [-1, 1]
    assert "range" in (check(_forged(e2, data=data)) or "")
    assert "unknown" in (check(_forged(e2, encoding="int3")) or "")


def test_int2_is_ternary_and_packs_four_per_byte() -> None:
    t = torch.tensor([3.0, -3.0, 0.2, 1.6, -1.4, 0.0, 2.9])
    e = encode(t, "int2")
    assert e.data.numel() == 2 and e.nbytes == 2 + 4
    assert decode(e).tolist() == pytest.approx([3.0, -3.0, 0.0, 3.0, 0.0, 0.0, 3.0])


# -- sparse: top-k of every chunk, in a value encoding, with 12-bit positions ---------------------


@pytest.mark.parametrize("value", ENCODINGS)
@pytest.mark.parametrize("numel", [0, 1, 40, 41, 4096, 4097, 3 * 4096 + 100, 65537])
def test_sparse_keeps_the_largest_of_every_chunk(value: str, numel: int) -> None:
    t = _sample(numel, seed=numel)
    e = encode(t, sparse(value, 0.01))
    assert e.encoding == f"{value}+top41" and check(e) is None
    assert e.nbytes == encoded_nbytes(numel, e.encoding) == sum(frame_nbytes(numel, e.encoding))
    out = decode(e)
    went = torch.zeros(numel, dtype=torch.bool)
    went[positions(e, 41)] = True
    assert (
        int(went.sum())
        == kept(numel, e.encoding)
        == numel // CHUNK * 41 + (max(1, round(41 * (numel % CHUNK) / CHUNK)) if numel % CHUNK else 0)
    )
    assert bool((out[~went] == 0).all())  # nothing decodes where nothing went
    if value == "fp32":
        assert torch.equal(out[went], t[went])
    for start in range(0, numel, CHUNK):  # each chunk: nothing left out is larger than what went
        chunk, sent = t[start : start + CHUNK].abs(), went[start : start + CHUNK]
        if bool((~sent).any()):
            assert chunk[~sent].max() <= chunk[sent].min()


def test_sparse_names_densities_and_sizes() -> None:
    assert sparse("int2", 1.0) == "int2" and sparse("int2", 0.03) == "int2+top123"
    assert sparse("int4", 1e-9) == "int4+top1" and sparse("fp32", 0.99999) == "fp32"
    assert parse("int2+top41") == ("int2", 41) and parse("int4") == ("int4", 0)
    bad_names = (
        "int2+top0",
        "int2+top4096",
        "int2+top041",
        "int2+top",
        "int2+top4.1",
        "top41",
        "int3+top4",
        "int2+top٤",
    )
    for bad in bad_names:
        assert parse(bad) is None
        with pytest.raises(ConfigError, match=r"\+top<k>"):
            encoded_nbytes(10, bad)
    assert density("int2+top41") == 41 / CHUNK and density("int8") == 1.0
    n = 1 << 22  # 1 % at 2 bits and a 12-bit position: ~0.14 bits a value, ~220x below fp32's 32
    assert 200 < encoded_nbytes(n, "fp32") / encoded_nbytes(n, "int2+top41") < 240
    assert index_nbytes(0) == 0 and index_nbytes(1) == index_nbytes(2) == 3
    # a tensor shorter than a chunk keeps its share of k, at least one: a bias is as sparse as the rest
    assert kept(64, "int2+top123") == 2 and kept(64, "int2+top41") == 1 and kept(1, "int2+top1") == 1
    assert kept(2048, "int2+top41") == 20 and kept(4096 + 2048, "int2+top41") == 61


@pytest.mark.parametrize("value", ["int2", "int4", "fp32"])
def test_sparse_keeps_non_finite_values_visible(value: str) -> None:
    t = torch.zeros(5000)
    t[4500] = 1.0
    t[17] = math.nan
    out = decode(encode(t, f"{value}+top1"))
    assert not bool(torch.isfinite(out).all())


def test_error_feedback_makes_top_k_lossless_over_rounds() -> None:
    """Top-1 % at 2 bits loses 99 % of each round's values; with the residual carried, what was
    sent over T rounds is T rounds' worth of the input less the last residual, which stays
    bounded: the sum sent converges on the sum given (SparseLoCo's premise)."""
    g = torch.Generator().manual_seed(1)
    target = torch.randn(3 * CHUNK, generator=g)
    residual, sent = torch.zeros_like(target), torch.zeros_like(target)
    norms = []
    for t in range(1, 401):
        payload = target + residual
        decoded = decode(encode(payload, "int2+top41"))
        residual, sent = payload - decoded, sent + decoded
        norms.append(float(residual.norm()))
        assert torch.allclose(sent + residual, t * target, rtol=1e-4, atol=1e-3)  # nothing is lost
    assert max(norms[200:]) <= 1.05 * max(norms[:200])  # the residual stays bounded
    err = float((sent / 400 - target).norm() / target.norm())
    assert err < 0.25  # without feedback, 1 % of the values (err ~0.99)
    once = decode(encode(target, "int2+top41"))
    assert float((once - target).norm() / target.norm()) > 0.9


@settings(max_examples=150, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=400),
    numel=st.integers(0, 9000),
    value=st.sampled_from(ENCODINGS),
    k=st.integers(1, 200),
)
def test_sparse_check_is_total_on_forged_payloads(data: bytes, numel: int, value: str, k: int) -> None:
    """Any bytes as a sparse payload's parts: ``check`` answers (a reason or None), never raises,
    and what it passes decodes to the right shape."""
    name = f"{value}+top{k}"
    n_scales, n_data, n_positions = frame_nbytes(numel, name)
    raw = (data * (1 + (n_scales + n_data + n_positions) // max(1, len(data))))[: n_scales + n_data + n_positions]
    raw = raw.ljust(n_scales + n_data + n_positions, b"\x00")
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
    dtype = DATA_DTYPE[value]
    e = Encoded(
        name,
        (numel,),
        torch.float32,
        buf[n_scales : n_scales + n_data].clone().view(dtype),
        buf[:n_scales].clone().view(torch.float32) if n_scales else None,
        buf[n_scales + n_data :].clone(),
    )
    problem = check(e)
    if problem is None:
        assert decode(e).shape == (numel,)
