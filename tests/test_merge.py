"""Golden numbers for token weights, weighted mean and weighted RDA."""

import math

import pytest
import torch

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import TensorSpec, balanced_layout
from ddiloco.core.merge import (
    CHUNK,
    PER_THREAD,
    Accumulator,
    chunk_elements,
    make_delta,
    spans,
    token_weight,
    weighted_mean,
    weighted_rda,
)
from ddiloco.core.messages import Contribution, Join
from ddiloco.core.outer import OuterNesterov
from ddiloco.core.syncer import Syncer


def test_token_weight_is_tokens_squared_over_steps():
    assert token_weight(100, 4) == 2500.0
    assert token_weight(0, 0) == 0.0
    assert token_weight(50, 0) == 0.0  # no steps: no weight


def test_weighted_mean_golden():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])
    out = weighted_mean([a, b], [1.0, 3.0])
    assert torch.allclose(out, torch.tensor([0.25, 2.25]))


@pytest.mark.parametrize("m", [2, 4, 8, 16, 32])
def test_rda_norm_independent_of_m_for_equal_norm_inputs(m):
    g = torch.Generator().manual_seed(m)
    deltas = [torch.randn(4096, generator=g) for _ in range(m)]
    deltas = [3.0 * d / d.norm() for d in deltas]  # equal norms, nearly orthogonal
    out = weighted_rda(deltas, [1.0] * m)
    assert math.isclose(float(out.norm()), 3.0, rel_tol=1e-5)
    # ... while the plain mean shrinks like 1/sqrt(M)
    assert float(weighted_mean(deltas, [1.0] * m).norm()) < 3.0 * 1.5 / math.sqrt(m)


def test_rda_of_identical_inputs_is_that_input():
    d = torch.randn(7, 5)
    assert torch.allclose(weighted_rda([d, d, d], [1.0, 2.0, 5.0]), d, atol=1e-6)


def test_rda_lone_contribution_unchanged():
    d = torch.randn(3, 3)
    assert torch.equal(weighted_rda([d], [7.0]), d)


def test_rda_zero_vectors():
    z = torch.zeros(5)
    assert torch.equal(weighted_rda([z, z], [1.0, 1.0]), z)
    d = torch.tensor([0.0, 2.0, 0.0, 0.0, 0.0])
    # unit(0) = 0: the zero vector only shrinks the radius, not the direction.
    out = weighted_rda([z, d], [1.0, 1.0])
    assert torch.allclose(out, torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]))


def test_rda_golden_two_orthogonal():
    a, b = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 4.0])
    out = weighted_rda([a, b], [1.0, 1.0])
    # radius (2+4)/2 = 3 along unit((1,0)+(0,1)) = (1,1)/sqrt2
    assert torch.allclose(out, torch.tensor([3 / math.sqrt(2), 3 / math.sqrt(2)]))


def test_embedding_like_pieces_use_the_mean_and_the_others_rda():
    layout = balanced_layout([TensorSpec("emb", (2,)), TensorSpec("w", (2,))], 1)
    init = {"emb": torch.zeros(2), "w": torch.zeros(2)}
    cfg = DiLoCoConfig(
        num_fragments=1,
        quorum=2,
        grace=False,
        late_fragment="wait",
        overlap=0,
        outer_lr=1.0,
        outer_momentum=0.0,
        merge="rda",
        max_delta_floor=10.0,  # toy values from zero: the relative norm bound is far above them,
    )
    s = Syncer(cfg, layout, init, [True, False])
    for m in (0, 1):
        s.handle(Join(m, 0, [0]), 0.0)
    # deltas = anchor (0) - values: learner 0 moves by [2, 0], learner 1 by [0, 4]
    for m, d in ((0, [2.0, 0.0]), (1, [0.0, 4.0])):
        values = [-torch.tensor(d), -torch.tensor(d)]
        s.handle(
            Contribution(
                learner=m,
                incarnation=0,
                fragment=0,
                base_version=0,
                seq=1,
                values=values,
                steps=1,
                tokens=1,
                data_position=0,
                step=0,
            ),
            1.0,
        )
    emb, other = s.fragments[0].values
    assert torch.allclose(emb, -torch.tensor([1.0, 2.0]))  # the mean
    assert torch.allclose(other, -torch.tensor([3 / math.sqrt(2), 3 / math.sqrt(2)]))  # RDA: mean norm 3


@pytest.mark.parametrize("rda", [True, False])
def test_arrival_time_merge_equals_the_merge_of_materialised_deltas(rda):
    g = torch.Generator().manual_seed(1)
    n = 2 * CHUNK + 123  # several chunks and a ragged tail
    anchors = [torch.randn(n, generator=g) for _ in range(2)]  # two learners share a base, one does not
    values = [
        anchors[0] + 0.01 * torch.randn(n, generator=g),
        anchors[0] + 0.01 * torch.randn(n, generator=g),
        anchors[1] + 0.01 * torch.randn(n, generator=g),
    ]
    bases = [anchors[0], anchors[0], anchors[1]]
    weights = [1.0, 2.0, 0.5]
    deltas = [a - v for a, v in zip(bases, values)]
    originals = [a.clone() for a in anchors]
    acc = Accumulator(torch.full((n,), float("nan")), rda)  # scratch contents do not matter
    for a, v, w, d in zip(bases, values, weights, deltas):
        norm = make_delta(a, v)
        assert math.isclose(norm, float(d.norm()), rel_tol=1e-5)
        assert torch.equal(v, d)  # the payload now holds its delta, computed as a - v
        acc.add(v, norm, w)
    # a replaced answer is taken back out exactly as it went in
    extra = torch.randn(n, generator=g)
    acc.add(extra, float(extra.norm()), 3.0)
    acc.add(extra, float(extra.norm()), 3.0, sign=-1.0)
    ours = acc.result()
    ref = weighted_rda(deltas, weights) if rda else weighted_mean(deltas, weights)
    assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-6)
    if not rda:  # the mean by hand: sum(w d) / sum(w)
        assert torch.allclose(ours, sum(w * d for w, d in zip(weights, deltas)) / sum(weights), atol=1e-6)
    assert all(torch.equal(a, o) for a, o in zip(anchors, originals))  # anchors are never written


def test_non_finite_values_give_a_non_finite_norm():
    v = torch.zeros(CHUNK + 5)
    v[CHUNK + 2] = math.nan
    assert not math.isfinite(make_delta(torch.zeros_like(v), v.clone()))
    assert not math.isfinite(make_delta(None, v))


def _reference_nesterov(lr, momentum, p, grads):
    """The whole-tensor operations the chunked outer step must equal bit for bit."""
    b, out = None, []
    for g in grads:
        g = g.clone()
        if b is None:
            b = g.clone()
        else:
            torch.add(g, b, alpha=momentum, out=b)
        g.add_(b, alpha=momentum)
        p = torch.add(p, g, alpha=-lr)
        out.append(p)
    return out


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes()


@pytest.mark.parametrize("threads", [1, 2])
def test_the_chunked_outer_step_is_bit_identical_to_whole_tensor_operations(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(3)
        n = 2 * CHUNK + 77
        start = torch.randn(n, generator=g)
        grads = [torch.randn(n, generator=g) for _ in range(3)]
        want = _reference_nesterov(0.7, 0.9, start, grads)
        outer, p, recycled = OuterNesterov(0.7, 0.9), start, torch.empty(n)
        for i, (gr, w) in enumerate(zip(grads, want)):
            out = [recycled] if i == 2 else None  # a recycled version is written in place
            (p,) = outer.step([p], [gr.clone()], out=out)
            assert _same_bits(p, w)
        assert p is recycled
    finally:
        torch.set_num_threads(before)


def test_the_outer_step_without_momentum_and_on_a_non_contiguous_gradient():
    g = torch.Generator().manual_seed(4)
    p, grad = torch.randn(300, 200, generator=g), torch.randn(200, 300, generator=g).t()
    (new,) = OuterNesterov(0.5, 0.0).step([p], [grad.clone()])
    assert _same_bits(new, torch.add(p, grad, alpha=-0.5))
    outer = OuterNesterov(0.5, 0.9)
    scratch = grad.clone()
    assert not scratch.is_contiguous()
    (a,) = outer.step([p], [scratch])  # one chunk: the whole tensor
    assert _same_bits(a, _reference_nesterov(0.5, 0.9, p, [grad.contiguous()])[0])
    with pytest.raises(ValueError, match="out has 2 tensors for 1"):
        outer.step([p], [grad], out=[p, p])


@pytest.mark.parametrize("rda", [True, False])
def test_the_lazily_cleared_sum_equals_zero_then_add(rda):
    g = torch.Generator().manual_seed(5)
    n = CHUNK + 1000
    deltas = [torch.randn(n, generator=g) for _ in range(3)]
    deltas[0][:10] = -0.0  # 0 + (-0) is +0: the fused clear must keep that
    weights = [1.0, 0.5, 2.0]
    ref_acc = torch.zeros(n)  # the former way: zero_() at the open, then add_() per answer
    for d, w in zip(deltas, weights):
        norm = float(d.norm())
        ref_acc.add_(d, alpha=(w / norm) if rda else w)
    acc = Accumulator(torch.full((n,), float("nan")), rda)
    for d, w in zip(deltas, weights):
        acc.add(d, float(d.norm()), w)
    assert _same_bits(acc.acc, ref_acc)
    first = Accumulator(torch.full((n,), float("nan")), rda)
    first.add(deltas[0], float(deltas[0].norm()), 1.0)
    assert not torch.signbit(first.acc[:10]).any()  # +0, as zero_() then add_() gives


def test_a_sum_with_nothing_added_is_cleared_at_the_close():
    z = torch.zeros(CHUNK + 3)
    acc = Accumulator(torch.full_like(z, float("nan")), rda=True)
    acc.add(z.clone(), 0.0, 1.0)  # norm 0: unit(0) = 0, nothing is added
    acc.add(z.clone(), 0.0, 2.0)
    assert _same_bits(acc.result(), z)


def test_chunks_grow_with_the_thread_count():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert chunk_elements() == CHUNK
        torch.set_num_threads(16)
        assert chunk_elements() == 16 * PER_THREAD > CHUNK
        assert spans(chunk_elements() + 5) == [(0, chunk_elements()), (chunk_elements(), chunk_elements() + 5)]
    finally:
        torch.set_num_threads(before)
