"""Per-expert token weighting (``algo.expert_weights = "routed"``): counts in, rows weighed apart.

By hand: the row-by-row merge (mean and RDA), the syncer's choice of rows or whole tensors, the
learner's counters since each fragment's version, the checks on counts from outside (the syncer
refuses, the training loop's helper names the problem), the wire, and a simulated MoE run.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import Piece, TensorSpec, balanced_layout, tensor_rows
from ddiloco.core.learner import LearnerCore, routed_counts
from ddiloco.core.merge import RowAccumulator, row_factors
from ddiloco.core.messages import Contribution, FragmentUpdate, Join
from ddiloco.core.syncer import Syncer
from ddiloco.core.tape import Rejection
from ddiloco.core.validation import check_routed
from ddiloco.service.base.wire import WireError, decode, encode

# -- the row-by-row merge ---------------------------------------------------------------------


def test_row_factors_share_the_answers_weight_by_its_routed_tokens() -> None:
    f64 = torch.float64
    assert torch.equal(row_factors([0, 5, 15], 0, 3), torch.tensor([0.0, 0.75, 2.25], dtype=f64))
    assert torch.equal(row_factors([0, 5, 15], 1, 3), torch.tensor([0.75, 2.25], dtype=f64))  # a piece's rows
    assert torch.equal(row_factors([0, 0, 0], 0, 3), torch.zeros(3, dtype=f64))  # nothing routed
    # Counts move weight between rows, never add to it: whatever is claimed, the factors over the
    # tensor's rows sum to its row count (an honest even router gets all 1: the plain merge), and
    # a claim of every token on every expert is just the plain weight.
    for claim in ([10, 10, 10], [10, 0, 0], [3, 9, 1]):
        assert math.isclose(float(row_factors(claim, 0, 3).sum()), 3.0)
    assert torch.equal(row_factors([10, 10, 10], 0, 3), torch.ones(3, dtype=f64))


def test_the_row_mean_weighs_each_row_by_its_own_weights() -> None:
    acc = RowAccumulator(torch.full((3, 2), float("nan")), rda=False)
    a = torch.tensor([[1.0, 1.0], [2.0, 2.0], [5.0, 5.0]])
    b = torch.tensor([[3.0, 3.0], [4.0, 4.0], [7.0, 7.0]])
    acc.add(a, 0.0, 2.0, factors=torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64))  # row weights 2, 1, 0
    acc.add(b, 0.0, 1.0, factors=torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64))  # row weights 1, 1, 0
    out = acc.result()
    # row 0: (2*1 + 1*3) / 3; row 1: (1*2 + 1*4) / 2; row 2: nobody routed to it: zero (kept)
    assert torch.allclose(out, torch.tensor([[5 / 3, 5 / 3], [3.0, 3.0], [0.0, 0.0]]))


def test_row_rda_keeps_each_rows_mean_length_along_its_mean_direction() -> None:
    acc = RowAccumulator(torch.empty(2, 2), rda=True)
    acc.add(torch.tensor([[2.0, 0.0], [1.0, 0.0]]), 0.0, 1.0, factors=torch.tensor([1.0, 1.0], dtype=torch.float64))
    acc.add(torch.tensor([[0.0, 4.0], [0.0, 1.0]]), 0.0, 1.0, factors=torch.tensor([1.0, 3.0], dtype=torch.float64))
    out = acc.result()
    # row 0: equal weights, lengths 2 and 4: mean length 3 along the diagonal
    assert torch.allclose(out[0], torch.tensor([3 / math.sqrt(2), 3 / math.sqrt(2)]))
    # row 1: weights 1 and 3, both of length 1: length 1 along (1, 3) / sqrt(10)
    assert torch.allclose(out[1], torch.tensor([1.0, 3.0]) / math.sqrt(10))


def test_an_answer_taken_back_leaves_the_other_rows_as_they_were() -> None:
    acc = RowAccumulator(torch.empty(2, 1), rda=False)
    one, two = torch.tensor([[1.0], [2.0]]), torch.tensor([[9.0], [9.0]])
    f = torch.tensor([1.0, 0.5], dtype=torch.float64)
    acc.add(one, 0.0, 1.0, factors=f)
    acc.add(two, 0.0, 1.0, factors=f)
    acc.add(two, 0.0, 1.0, sign=-1.0, factors=f)
    assert torch.allclose(acc.result(), one)


# -- the syncer ---------------------------------------------------------------------------------


def _syncer(expert_weights: str = "routed") -> Syncer:
    layout = balanced_layout([TensorSpec("experts", (2, 2)), TensorSpec("router", (2, 2))], 1)
    init = {"experts": torch.zeros(2, 2), "router": torch.zeros(2, 2)}
    cfg = DiLoCoConfig(
        num_fragments=1,
        quorum=2,
        grace=False,
        late_fragment="wait",
        overlap=0,
        outer_lr=1.0,
        outer_momentum=0.0,
        merge="mean",
        expert_weights=expert_weights,  # type: ignore[arg-type]
        max_delta_floor=100.0,  # toy values from zero: far above the relative norm bound
    )
    s = Syncer(cfg, layout, init, [False, False])
    for m in (0, 1):
        s.handle(Join(m, 0, [0]), 0.0)
    return s


def _answer(m: int, delta: float, routed: list[list[int]], tokens: int = 10) -> Contribution:
    values = [torch.full((2, 2), -delta), torch.full((2, 2), -delta)]  # delta = anchor (0) - values
    return Contribution(m, 0, 0, 0, 1, values, steps=1, tokens=tokens, data_position=0, step=1, routed=routed)


def test_expert_rows_follow_the_tokens_each_learner_routed_to_them() -> None:
    s = _syncer()
    # learner 0 routed all 10 tokens to expert 0, learner 1 all to expert 1; the router has no counts
    s.handle(_answer(0, 1.0, [[10, 0], []]), 1.0)
    s.handle(_answer(1, 3.0, [[0, 10], []]), 1.0)
    experts, router = s.fragments[0].values
    assert torch.allclose(experts, torch.tensor([[-1.0, -1.0], [-3.0, -3.0]]))  # each row from its user
    assert torch.allclose(router, torch.full((2, 2), -2.0))  # plain token weights: the mean


def test_under_tokens_the_counts_change_nothing() -> None:
    s = _syncer("tokens")
    s.handle(_answer(0, 1.0, [[10, 0], []]), 1.0)
    s.handle(_answer(1, 3.0, [[0, 10], []]), 1.0)
    assert torch.allclose(s.fragments[0].values[0], torch.full((2, 2), -2.0))


def test_a_round_with_an_answer_without_counts_weighs_whole_tensors() -> None:
    s = _syncer()
    s.handle(_answer(0, 1.0, [[10, 0], []]), 1.0)
    s.handle(_answer(1, 3.0, []), 1.0)  # a model without counters: plain token weighting for all
    assert torch.allclose(s.fragments[0].values[0], torch.full((2, 2), -2.0))


def test_an_answer_of_no_steps_leaves_the_rows_weighed_apart() -> None:
    s = _syncer()
    s.handle(_answer(0, 1.0, [[10, 0], []]), 1.0)
    empty = Contribution(1, 0, 0, 0, 1, [torch.zeros(2, 2)] * 2, steps=0, tokens=0, data_position=0, step=0)
    s.handle(empty, 1.0)  # asked right after a version arrived: nothing to add, and no counts
    experts = s.fragments[0].values[0]
    assert torch.allclose(experts, torch.tensor([[-1.0, -1.0], [0.0, 0.0]]))  # row 1: nobody routed to it


def test_a_hostile_count_cannot_outweigh_an_honest_learner_beyond_its_token_weight() -> None:
    s = _syncer()
    s.handle(_answer(0, 1.0, [[10, 0], []]), 1.0)  # honest: every token to expert 0
    s.handle(_answer(1, 7.0, [[10, 10], []]), 1.0)  # claims every token on every expert
    experts = s.fragments[0].values[0]
    # row 0: factors 2 (honest) and 1 (the claim is the plain weight): (2 x 1 + 1 x 7) / 3
    assert torch.allclose(experts[0], torch.full((2,), -3.0))
    assert torch.allclose(experts[1], torch.full((2,), -7.0))  # row 1: only the claim


def test_counts_of_a_split_tensor_cover_its_whole_rows_in_every_piece() -> None:
    layout = balanced_layout([TensorSpec("experts", (8, 64)), TensorSpec("b", (8, 8))], 2)
    rows = tensor_rows(layout)
    assert rows == {"experts": 8, "b": 8}
    split = [pc for frag in layout.fragments for pc in frag if pc.name == "experts"]
    assert len(split) > 1 and max(pc.row_end for pc in split) == 8  # pieces in any order
    c = Contribution(0, 0, 0, 0, 1, [], steps=1, tokens=10, data_position=0, step=1)
    pieces = layout.fragments[0]
    good = [[1] * 8 if pc.name == "experts" else [] for pc in pieces]
    assert check_routed(dataclasses.replace(c, routed=good), pieces, rows) is None
    bad = [[1] * (pc.row_end - pc.row_start) if pc.name == "experts" else [] for pc in pieces]  # the piece's rows
    assert check_routed(dataclasses.replace(c, routed=bad), pieces, rows) is not None


@pytest.mark.parametrize(
    "routed, why",
    [
        ([[11, 0], []], "not an integer in [0, tokens=10]"),  # more than its tokens: a quadratic weight
        ([[-1, 0], []], "not an integer in [0, tokens=10]"),
        ([[1, 2, 3], []], "3 routed counts for experts (2 rows)"),
        ([[1, 2]], "routed counts for 1 pieces"),
        ([[1.5, 2], []], "not an integer"),
    ],
)
def test_counts_that_cannot_be_true_are_refused(routed: list[list[int]], why: str) -> None:
    s = _syncer()
    out = s.handle(_answer(0, 1.0, routed), 1.0)  # no round is open yet: the refusal goes on the tape
    refused = [r for r in out.tape if isinstance(r, Rejection)]
    assert [r.reason for r in refused] == ["bad_counters"]
    assert why in refused[0].detail
    assert torch.equal(s.fragments[0].values[0], torch.zeros(2, 2))  # nothing merged


# -- the learner --------------------------------------------------------------------------------


def _pieces() -> list[Piece]:
    # an expert tensor split by rows into two pieces, and a router piece without counts
    return [Piece("w", 0, 1, (1, 2)), Piece("w", 1, 3, (2, 2)), Piece("router", 0, 3, (3, 2))]


def test_the_learner_counts_routed_tokens_since_the_fragments_version() -> None:
    core = LearnerCore(DiLoCoConfig(num_fragments=1, expert_weights="routed"), 0, 1)
    core.on_step(10, {"w": torch.tensor([4, 6, 10])})
    core.on_step(10, {"w": torch.tensor([1, 9, 10])})
    c = core.contribution(0, [torch.zeros(1)] * 3, 0, pieces=_pieces())
    assert c.routed == [[5, 15, 20], [5, 15, 20], []] and c.tokens == 20  # each piece: its whole tensor
    core.sent(c)
    core.on_step(10, {"w": torch.tensor([2, 8, 10])})
    core.on_update(FragmentUpdate(0, 0, 1, [], 0.0, 1))  # the merge overwrites: counting starts again
    core.on_step(10, {"w": torch.tensor([3, 7, 0])})
    assert core.contribution(0, [torch.zeros(1)] * 3, 0, pieces=_pieces()).routed == [[3, 7, 0], [3, 7, 0], []]
    for reason in ("join", "stale"):  # a fetch or a rebase starts the count again too
        core.on_update(FragmentUpdate(0, 0, core.base_version[0] + 1, [], 0.0, 1, reason=reason))  # type: ignore[arg-type]
        assert core.contribution(0, [], 0, pieces=_pieces()).routed == [[0, 0, 0], [0, 0, 0], []]
        core.on_step(10, {"w": torch.tensor([1, 0, 0])})
        assert core.contribution(0, [], 0, pieces=_pieces()).routed == [[1, 0, 0], [1, 0, 0], []]


def test_the_learner_sends_no_counts_without_routed_or_without_steps_of_them() -> None:
    plain = LearnerCore(DiLoCoConfig(num_fragments=1), 0, 1)  # expert_weights = "tokens"
    plain.on_step(10, {"w": torch.tensor([4, 6, 10])})
    assert plain.contribution(0, [], 0, pieces=_pieces()).routed == []
    core = LearnerCore(DiLoCoConfig(num_fragments=1, expert_weights="routed"), 0, 1)
    core.on_step(10)  # a model without counters
    assert core.contribution(0, [], 0, pieces=_pieces()).routed == []


def test_under_shift_the_counts_after_the_answer_stay_for_the_next() -> None:
    core = LearnerCore(DiLoCoConfig(num_fragments=1, expert_weights="routed", on_merged="shift"), 0, 1)
    core.on_step(10, {"w": torch.tensor([4, 6, 10])})
    core.sent(core.contribution(0, [], 0, pieces=_pieces()))
    core.on_step(10, {"w": torch.tensor([1, 2, 3])})  # the overlap: kept by the shift
    core.on_update(FragmentUpdate(0, 0, 1, [], 0.0, 1))
    assert core.contribution(0, [], 0, pieces=_pieces()).routed == [[1, 2, 3], [1, 2, 3], []]


@pytest.mark.parametrize(
    "routed, why",
    [
        ({"nope": [1, 2, 3]}, "not a parameter"),
        ({"w": [1, 2]}, "2 values, its dim 0 has 3 rows"),
        ({"w": [1, 2, 11]}, "must lie in [0, tokens=10]"),
        ({"w": torch.tensor([0.5, 1.0, 2.0])}, "pass integers"),
        ({"w": 3}, "a tensor or a list of integers"),
        ({"big": [0] * 5000}, "at most 4096 experts"),
    ],
)
def test_the_training_loops_counts_are_checked_with_one_line(routed: dict[str, object], why: str) -> None:
    with pytest.raises(ValueError, match="routed counts") as e:
        routed_counts(routed, {"w": 3, "big": 5000}, 10)
    assert why in str(e.value)


def test_a_torchrun_groups_counts_scale_with_the_world_as_its_tokens() -> None:
    out = routed_counts({"w": torch.tensor([1, 2, 3], dtype=torch.int32)}, {"w": 3}, 10, scale=4)
    assert out["w"].dtype == torch.int64 and out["w"].tolist() == [4, 8, 12]


# -- the wire -----------------------------------------------------------------------------------


def test_counts_cross_the_wire_and_bad_ones_are_named() -> None:
    c = _answer(0, 1.0, [[10, 0], []])
    back = decode(encode(c))
    assert isinstance(back, Contribution) and back.routed == [[10, 0], []]
    frames = encode(c)
    frames[0] = bytes(frames[0]).replace(b'"routed":[[10,0],[]]', b'"routed":[[10,-1],[]]')
    with pytest.raises(WireError, match="routed"):
        decode(frames)


# -- a simulated mixture of experts --------------------------------------------------------------


def test_a_simulated_moe_run_weighs_expert_rows_by_their_routed_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    from test_moe import FACTORY, TINY

    from ddiloco.config import load_config
    from ddiloco.methods import PRESETS
    from ddiloco.sim.run import simulate

    fed: list[torch.Tensor] = []
    add = RowAccumulator.add  # the class the rounds merge with (core/round.py)

    def spy(self: RowAccumulator, *args: object, **kw: object) -> None:
        factors = kw.get("factors")
        assert isinstance(factors, torch.Tensor)
        fed.append(factors.clone())
        add(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(RowAccumulator, "add", spy)
    settings = [f"workload.factory={FACTORY}", *(f"workload.{k}={v}" for k, v in TINY.items())]
    settings += ["workload.eval_windows=64", "workload.options={experts = 4, top_k = 2}", "run.num_learners=2"]
    settings += ["run.processed_tokens=6000", "run.eval_points=1", "algo.sync_every=4"]
    results = {}
    for mode in ("tokens", "routed"):
        cfg = load_config(None, [*settings, f"algo.expert_weights={mode}"], base=PRESETS["decoupled"])
        results[mode] = simulate(cfg)
        assert not _rejections_of(results[mode].tape)
        if mode == "tokens":
            assert fed == []  # no rows weighed apart
    assert fed
    whole = [f for f in fed if f.numel() == 4]  # pieces holding all 4 experts: factors average 1
    assert whole and all(math.isclose(float(f.sum()), 4.0) for f in whole)
    assert all(float(f.min()) >= 0.0 and float(f.max()) <= 4.0 for f in fed)
    assert any(not torch.allclose(f, f[0].expand_as(f)) for f in whole)  # uneven routing
    assert math.isfinite(results["routed"].final_loss)
    assert results["routed"].final_loss != results["tokens"].final_loss  # the weighting did something


def _rejections_of(tape: list[dict[str, object]]) -> list[object]:
    """Refusals in rounds and outside them."""
    inside = [r for e in tape if e.get("event") == "round" for r in e.get("rejected") or []]  # type: ignore[attr-defined]
    return inside + [e for e in tape if e.get("event") == "rejected"]
