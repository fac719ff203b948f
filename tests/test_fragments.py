"""Fragment layouts: the bin-packing bounds, row splitting, the default P, the schedule."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.core.fragments import (
    TensorSpec,
    balanced_layout,
    default_num_fragments,
    due_fragments,
    fragment_offset,
    imbalance,
    make_layout,
    pack_sizes,
    per_layer_layout,
    read_fragment,
    strided_layout,
    write_fragment,
)
from ddiloco.errors import ConfigError


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=60), st.integers(1, 16))
def test_lpt_bound_on_random_sizes(sizes, p):
    bins = pack_sizes(sizes, p)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    heaviest = max(sum(sizes[i] for i in b) for b in bins)
    assert heaviest <= sum(sizes) / p + (1 - 1 / p) * max(sizes) + 1e-9


def _optimum(sizes, p):
    best = math.inf
    for assign in itertools.product(range(p), repeat=len(sizes)):
        loads = [0] * p
        for s, b in zip(sizes, assign):
            loads[b] += s
        best = min(best, max(loads))
    return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=7), st.integers(2, 3))
def test_lpt_within_four_thirds_of_brute_force_optimum(sizes, p):
    bins = pack_sizes(sizes, p)
    heaviest = max(sum(sizes[i] for i in b) for b in bins)
    assert heaviest <= (4 / 3 - 1 / (3 * p)) * _optimum(sizes, p) + 1e-9


def gpt_like_specs():
    specs = [TensorSpec("tok_emb.weight", (256, 64)), TensorSpec("pos_emb.weight", (128, 64))]
    for i in range(4):
        specs += [
            TensorSpec(f"blocks.{i}.ln1.weight", (64,)),
            TensorSpec(f"blocks.{i}.attn.qkv.weight", (192, 64)),
            TensorSpec(f"blocks.{i}.attn.proj.weight", (64, 64)),
            TensorSpec(f"blocks.{i}.mlp.fc.weight", (256, 64)),
            TensorSpec(f"blocks.{i}.mlp.proj.weight", (64, 256)),
        ]
    return specs + [TensorSpec("lm_head.weight", (256, 64))]


def test_large_p_splits_rows_and_stays_balanced():
    specs = gpt_like_specs()
    layout = balanced_layout(specs, 24)
    assert layout.num_fragments == 24
    assert sum(layout.sizes()) == sum(s.numel for s in specs)
    assert imbalance(layout) <= 1.25
    # without splitting, 24 bins over these tensors could not be that balanced
    whole = pack_sizes([s.numel for s in specs], 24)
    loads = [sum(specs[i].numel for i in b) for b in whole]
    assert max(loads) / (sum(loads) / 24) > 1.25


def test_every_row_covered_exactly_once():
    specs = gpt_like_specs()
    layout = balanced_layout(specs, 17)
    rows = {s.name: [0] * (s.shape[0]) for s in specs}
    for frag in layout.fragments:
        for pc in frag:
            for r in range(pc.row_start, pc.row_end):
                rows[pc.name][r] += 1
    assert all(c == 1 for v in rows.values() for c in v)


def test_default_p_keeps_largest_within_1_25_of_mean():
    specs = gpt_like_specs()
    p = default_num_fragments(specs, sync_every=24)
    assert 1 <= p <= 24
    assert imbalance(balanced_layout(specs, p)) <= 1.25
    assert make_layout(specs, None, "balanced", 24).num_fragments == p


def test_per_layer_and_strided():
    specs = gpt_like_specs()
    per_layer = per_layer_layout(specs)
    assert per_layer.num_fragments == 4 + 3  # four blocks + tok_emb, pos_emb, lm_head
    strided = strided_layout(specs, 3)
    assert [pc.name for pc in strided.fragments[1]][:2] == [specs[1].name, specs[4].name]
    with pytest.raises(ConfigError):
        strided_layout(specs[:2], 3)


def test_read_write_fragment_round_trip_and_blend():
    params = {"a": torch.arange(12.0).reshape(4, 3), "b": torch.ones(2)}
    layout = balanced_layout([TensorSpec("a", (4, 3)), TensorSpec("b", (2,))], 3)
    for frag in layout.fragments:
        vals = read_fragment(params, frag)
        write_fragment(params, frag, [v + 1 for v in vals])
    assert torch.equal(params["a"], torch.arange(12.0).reshape(4, 3) + 1)
    frag = layout.fragments[0]
    write_fragment(params, frag, [torch.zeros_like(v) for v in read_fragment(params, frag)], alpha=0.5)
    for pc in frag:
        assert torch.equal(
            params[pc.name][pc.row_start : pc.row_end], 0.5 * (read_fragment({pc.name: params[pc.name]}, [pc])[0] * 2)
        )


def test_schedule_offsets_and_due():
    assert [fragment_offset(p, 24, 24) for p in range(24)] == list(range(24))
    assert [fragment_offset(p, 4, 24) for p in range(4)] == [0, 6, 12, 18]
    seen = [p for t in range(24) for p in due_fragments(t, 4, 24)]
    assert sorted(seen) == [0, 1, 2, 3]  # each fragment exactly once per period
    assert due_fragments(30, 4, 24) == [1]
    assert due_fragments(48, 1, 24) == [0]
