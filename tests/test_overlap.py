"""Keeping the overlap's progress (``algo.on_merged``): the rule by hand, the session, a run."""

import dataclasses

import pytest
import torch

from ddiloco.config import load_config
from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import Piece, write_fragment
from ddiloco.core.learner import LearnerCore
from ddiloco.core.messages import FragmentUpdate
from ddiloco.core.overlap import OverlapKeeper
from ddiloco.errors import ConfigError
from ddiloco.methods import PRESETS
from ddiloco.sim.run import simulate

PIECES = [[Piece("w", 0, 2, (2,)), Piece("n", 0, 1, (1,), "int_buffer")]]
THETA0 = [torch.tensor([1.0, 2.0]), torch.tensor([3])]
THETA1 = [torch.tensor([0.95, 2.0]), torch.tensor([5])]  # the merge: w moved, the count is the fleet's
STEP1, STEP2 = torch.tensor([-0.1, 0.1]), torch.tensor([-0.1, 0.2])  # what two inner steps change in w


def _run(on_merged: str, outer_lr: float = 0.5) -> tuple[dict[str, torch.Tensor], LearnerCore]:
    """One fragment, two steps of 10 tokens: step 1, send, step 2 (the overlap), then the merge
    of version 1 arrives. Returns the learner's tensors and its core."""
    cfg = DiLoCoConfig(num_fragments=1, sync_every=4, overlap=1, on_merged=on_merged, outer_lr=outer_lr)  # type: ignore[arg-type]
    core, keeper = LearnerCore(cfg, 0, 1), OverlapKeeper(cfg, PIECES)
    params = {"w": THETA0[0].clone(), "n": THETA0[1].clone()}
    core.on_step(10)
    params["w"] += STEP1
    c = core.contribution(0, keeper.undisplaced(0, [params["w"].clone(), params["n"].clone()]), data_position=1)
    keeper.sent(0, THETA0, c.values)
    core.sent(c)
    for p, move in keeper.moves():  # the next boundary: the eager move first
        write_fragment(params, PIECES[p], move, add=True)
    core.on_step(10)
    params["w"] += STEP2
    receipt = core.on_update(FragmentUpdate(0, 0, 1, THETA1, 40.0, 4))
    if receipt.mode == "shift":
        write_fragment(params, PIECES[0], keeper.change(0, THETA1, THETA0), add=True)
    else:
        keeper.drop(0)
        write_fragment(params, PIECES[0], THETA1, receipt.alpha)
    return params, core


def test_overwrite_loses_the_overlap_step_and_counts_it_overwritten():
    params, core = _run("overwrite")
    assert torch.equal(params["w"], THETA1[0]) and int(params["n"]) == 5
    assert core.tokens == [0] and core.steps == [0] and core.kept_tokens == 0
    assert core.fleet_tokens() == 40.0 + 4 * 10 / 1  # the overwritten step still counts as processed


@pytest.mark.parametrize("rule", ["shift", "eager"])
def test_shift_and_eager_keep_exactly_the_steps_since_the_contribution(rule):
    """theta_send = [0.9, 2.1]; after the overlap step theta = [0.8, 2.3]. The merge Theta_1 =
    [0.95, 2.0] already holds this learner's contribution, so the learner takes Theta_1 plus its
    step since sending: [0.85, 2.2], not theta + (Theta_1 - Theta_0) = [0.75, 2.3], which would
    count the contribution twice. Its 10 tokens stay counted for the next contribution."""
    params, core = _run(rule)
    assert torch.allclose(params["w"], torch.tensor([0.85, 2.2]))
    assert int(params["n"]) == 5  # a count takes the merged value
    assert core.tokens == [10] and core.steps == [1] and core.kept_tokens == 10


def test_eager_moves_to_its_own_guess_and_a_contribution_never_sends_the_move():
    cfg = DiLoCoConfig(num_fragments=1, sync_every=4, overlap=1, on_merged="eager", outer_lr=0.5)
    keeper = OverlapKeeper(cfg, PIECES)
    sent_w = THETA0[0] + STEP1  # [0.9, 2.1]: delta [0.1, -0.1]
    keeper.sent(0, THETA0, [sent_w, THETA0[1]])
    [(p, move)] = keeper.moves()
    # Theta_0 - outer_lr * delta = [0.95, 2.05]: the learner's guess of version 1
    assert torch.allclose(sent_w + move[0], torch.tensor([0.95, 2.05]))
    assert move[1].numel() == 0  # the count is left alone
    assert keeper.moves() == []  # one move per contribution
    keeper.sent(0, THETA0, [sent_w + STEP2, THETA0[1]])  # a second one from the same base: no second move
    assert keeper.moves() == []
    local = [sent_w + move[0] + STEP2, THETA0[1]]
    assert torch.allclose(keeper.undisplaced(0, local)[0], sent_w + STEP2)  # progress only, never the guess
    keeper.drop(0)  # a join or rebase overwrites: nothing displaced is left
    assert keeper.displaced == {} and keeper.sent_delta == {}


def test_a_fragment_never_contributed_keeps_all_its_steps():
    cfg = DiLoCoConfig(num_fragments=1, sync_every=4, overlap=1, on_merged="shift")
    core, keeper = LearnerCore(cfg, 0, 1), OverlapKeeper(cfg, PIECES)
    for _ in range(3):
        core.on_step(10)
    assert core.on_update(FragmentUpdate(0, 0, 1, THETA1, 40.0, 4)).mode == "shift"
    change = keeper.change(0, THETA1, THETA0)
    assert torch.allclose(change[0], THETA1[0] - THETA0[0])  # the fleet's change on top of local
    assert core.tokens == [30] and core.kept_tokens == 0


def test_a_join_overwrites_under_every_rule():
    cfg = DiLoCoConfig(num_fragments=1, sync_every=4, overlap=1, on_merged="shift")
    core = LearnerCore(cfg, 0, 1)
    core.on_step(10)
    assert core.on_update(FragmentUpdate(0, 0, 3, THETA1, 40.0, 4, reason="join")).mode == "overwrite"
    assert core.tokens == [0]


def test_the_rule_is_validated():
    with pytest.raises(ConfigError, match="on_merged"):
        DiLoCoConfig(on_merged="keep").validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="alpha"):
        DiLoCoConfig(on_merged="shift", alpha=0.5).validate()
    DiLoCoConfig(on_merged="eager").validate()


SYNTH = [
    "workload.factory=ddiloco.workloads.synthetic:make_workload",
    "workload.batch_size=16",
    "run.eval_points=2",
    "run.processed_tokens=12800",
    "algo.sync_every=6",
]


@pytest.mark.parametrize("rule", ["shift", "eager"])
def test_a_simulated_run_merges_the_overlap_tokens_it_keeps(rule):
    """At H = 6 with tau = 2 overwriting loses about a third of every period's steps on the
    fragments in flight; keeping them brings the merged share to (nearly) all tokens."""
    runs = {}
    for r in ("overwrite", rule):
        cfg = load_config(None, [*SYNTH, "run.method=decoupled", f"algo.on_merged={r}"], base=PRESETS["decoupled"])
        runs[r] = simulate(cfg).summary()
    assert runs["overwrite"]["merged_share"] < 0.9
    assert runs[rule]["merged_share"] > runs["overwrite"]["merged_share"] + 0.05
    assert runs[rule]["merged_share"] <= 1.0
    assert runs[rule]["eval_loss"] == pytest.approx(runs[rule]["eval_loss"])  # finite
    assert 0 < runs[rule]["eval_loss"] < 10


def test_a_session_adds_the_change_and_moves_eagerly_in_the_simulator():
    """The driver path end to end: an eager run's learners apply moves and shifts, and the run's
    result is the same as a replay (the rule is deterministic)."""
    extra = ["run.method=decoupled", "algo.on_merged=eager", "run.processed_tokens=6400"]
    a = simulate(load_config(None, [*SYNTH, *extra], base=PRESETS["decoupled"])).summary()
    b = simulate(load_config(None, [*SYNTH, *extra], base=PRESETS["decoupled"])).summary()
    assert a["eval_loss"] == b["eval_loss"] and a["tokens_merged"] == b["tokens_merged"]


def test_dataclass_default_overwrites():
    assert dataclasses.fields(DiLoCoConfig)  # the config is a dataclass
    assert DiLoCoConfig().on_merged == "overwrite"
