"""Golden numbers for token weights, weighted mean and weighted RDA."""

import math

import pytest
import torch

from ddiloco.core.merge import CHUNK, Term, delta_norm, merge_fragment, merge_tensor, token_weight, weighted_mean, weighted_rda


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


def test_merge_deltas_uses_mean_for_embedding_like_pieces():
    a = [torch.tensor([2.0, 0.0]), torch.tensor([2.0, 0.0])]
    b = [torch.tensor([0.0, 4.0]), torch.tensor([0.0, 4.0])]
    terms = lambda deltas: [Term(None, d, float(d.norm())) for d in deltas]  # noqa: E731
    emb, other = merge_fragment([terms(a), terms(b)], [1.0, 1.0], [True, False], "rda")
    assert torch.allclose(emb, torch.tensor([1.0, 2.0]))
    assert torch.allclose(other, torch.tensor([3 / math.sqrt(2), 3 / math.sqrt(2)]))
    emb2, other2 = merge_fragment([terms(a), terms(b)], [1.0, 1.0], [True, False], "mean")
    assert torch.allclose(other2, torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("rda", [True, False])
def test_anchored_chunked_merge_equals_the_merge_of_materialised_deltas(rda):
    g = torch.Generator().manual_seed(1)
    n = 2 * CHUNK + 123  # several chunks and a ragged tail
    anchors = [torch.randn(n, generator=g) for _ in range(2)]  # two learners share a base, one does not
    values = [anchors[0] + 0.01 * torch.randn(n, generator=g), anchors[0] + 0.01 * torch.randn(n, generator=g),
              anchors[1] + 0.01 * torch.randn(n, generator=g)]
    bases = [anchors[0], anchors[0], anchors[1]]
    weights = [1.0, 2.0, 0.5]
    deltas = [a - v for a, v in zip(bases, values)]
    for a, v, d in zip(bases, values, deltas):
        assert math.isclose(delta_norm(a, v), float(d.norm()), rel_tol=1e-5)
    terms = [Term(a, v, delta_norm(a, v)) for a, v in zip(bases, values)]
    originals = [t.clone() for t in [*anchors, *values]]
    ours = merge_tensor(terms, weights, rda=rda)
    ref = weighted_rda(deltas, weights) if rda else weighted_mean(deltas, weights)
    assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-7)
    # the reference by hand, for the mean: sum(w d) / sum(w)
    if not rda:
        assert torch.allclose(ours, sum(w * d for w, d in zip(weights, deltas)) / sum(weights), atol=1e-6)
    # inputs are never modified: the syncer keeps them as anchors and payloads
    assert all(torch.equal(t, o) for t, o in zip([*anchors, *values], originals))


def test_non_finite_values_give_a_non_finite_norm():
    v = torch.zeros(CHUNK + 5)
    v[CHUNK + 2] = math.nan
    assert not math.isfinite(delta_norm(torch.zeros_like(v), v))
    assert not math.isfinite(delta_norm(None, v))
