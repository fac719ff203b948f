"""The Mixture-of-Experts GPT workload: routing, the load-balancing loss, the options, its
fragments, and a short simulated run through the library."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ddiloco.config import load_config
from ddiloco.core.config import DiLoCoConfig
from ddiloco.errors import ConfigError
from ddiloco.methods import PRESETS
from ddiloco.sim.run import simulate
from ddiloco.training.evaluate import evaluate
from ddiloco.training.layout import layout_for
from ddiloco.workloads.base import Workload
from ddiloco.workloads.config import WorkloadConfig, load_workload
from ddiloco.workloads.gpt import GPTConfig
from ddiloco.workloads.moe import MoEConfig, MoEFeedForward, MoEGPT, MoEWorkload

FACTORY = "ddiloco.workloads.moe:make_workload"
TINY = {"d_model": 32, "n_layer": 2, "n_head": 2, "seq_len": 32, "batch_size": 8, "eval_windows": 32}
EXPERT_TENSORS = ("moe.w_in", "moe.w_out", "moe.router.weight")


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def workload(**options: object) -> MoEWorkload:
    w = load_workload(WorkloadConfig(factory=FACTORY, options=dict(options), **TINY))  # type: ignore[arg-type]
    assert isinstance(w, MoEWorkload)
    return w


def ffns(model: MoEGPT) -> list[MoEFeedForward]:
    return [b.moe for b in model.blocks]  # type: ignore[union-attr]


def test_the_workload_contract_and_the_shakespeare_data() -> None:
    w = workload()
    assert isinstance(w, Workload)
    dense = load_workload(WorkloadConfig(factory="ddiloco.workloads.shakespeare:make_workload", **TINY))  # type: ignore[arg-type]
    for a, b in zip(w.eval_batches(), dense.eval_batches(), strict=True):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets) and a.tokens == b.tokens
    s1, s2 = w.train_stream(1, 3, 7), dense.train_stream(1, 3, 7)
    for _ in range(3):
        a, b = s1.next_batch(), s2.next_batch()
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    names = [n for n, _ in w.build_model(0).named_parameters()]
    assert [n for n in names if w.is_embedding_like(n)] == ["tok_emb.weight", "pos_emb.weight", "lm_head.weight"]
    assert "blocks.1.moe.w_in" in names and not any(".mlp." in n for n in names)


def test_forward_backward_reaches_every_parameter_and_every_expert() -> None:
    w = workload(experts=4, top_k=2)
    model = w.build_model(0)
    assert isinstance(model, MoEGPT)
    batch = w.train_stream(0, 1, 0).next_batch()
    loss = w.loss(model, batch)
    assert math.isfinite(float(loss.detach()))
    routed = model.routed_tokens()
    assert routed.shape == (2, 4) and routed.dtype == torch.int64
    assert (routed > 0).all()  # the premise: every expert of every block got tokens
    assert (routed.sum(dim=1) == batch.inputs.numel() * 2).all()  # top_k assignments per token
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if name.endswith(EXPERT_TENSORS):  # each expert's slice, and each expert's router row
            assert (p.grad.flatten(1).abs().sum(dim=1) > 0).all(), name


@pytest.mark.parametrize("top_k", [1, 2])
def test_routing_is_deterministic(top_k: int) -> None:
    w = workload(experts=4, top_k=top_k)
    batch = w.eval_batches()[0]
    a, b, c = w.build_model(3), w.build_model(3), w.build_model(4)
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), na
    assert not torch.equal(a.blocks[0].moe.w_in, c.blocks[0].moe.w_in)  # type: ignore[index,union-attr]
    assert torch.equal(a(batch.inputs), b(batch.inputs))
    assert torch.equal(a.routed_tokens(), b.routed_tokens())  # type: ignore[operator]
    assert int(a.routed_tokens().sum()) == 2 * batch.inputs.numel() * top_k  # type: ignore[operator]


def test_ties_go_to_the_lowest_expert() -> None:
    model = workload(experts=4, top_k=2).build_model(0)
    assert isinstance(model, MoEGPT)
    with torch.no_grad():
        for f in ffns(model):
            f.router.weight.zero_()  # every probability 1/4
    model(torch.zeros(2, 8, dtype=torch.long))
    assert model.routed_tokens().tolist() == [[16, 16, 0, 0]] * 2


def test_aux_loss_is_one_for_a_uniform_router_and_the_eval_loss_excludes_it() -> None:
    w = workload(experts=4, top_k=2, aux_loss_coef=0.5)
    model = w.build_model(0)
    assert isinstance(model, MoEGPT)
    batch = w.train_stream(0, 1, 0).next_batch()
    with torch.no_grad():
        for f in ffns(model):
            f.router.weight.zero_()
    model.train()
    loss = w.loss(model, batch)
    with torch.no_grad():
        lm = F.cross_entropy(model(batch.inputs).flatten(0, 1), batch.targets.flatten())
    assert model.last_aux_loss is not None and model.last_lm_loss is not None
    assert float(model.last_aux_loss) == pytest.approx(2.0, abs=1e-6)  # 1.0 in each of the 2 blocks
    assert float(model.last_lm_loss) == pytest.approx(float(lm), abs=1e-6)
    assert float(loss.detach()) == pytest.approx(float(lm) + 0.5 * 2.0, abs=1e-5)
    model.eval()
    assert float(w.loss(model, batch).detach()) == pytest.approx(float(lm), abs=1e-6)
    # evaluate() (the runtimes' held-out loss) reports the pure next-byte loss
    batches = w.eval_batches()[:2]
    with torch.no_grad():
        pure = [F.cross_entropy(model(b.inputs).flatten(0, 1), b.targets.flatten()) for b in batches]
    expected = sum(float(x) * b.tokens for x, b in zip(pure, batches)) / sum(b.tokens for b in batches)
    model.train()
    assert evaluate(w, model, batches) == pytest.approx(expected, rel=1e-6)
    assert model.training  # evaluate() restored the mode


@pytest.mark.parametrize("top_k", [1, 2])
def test_aux_loss_grows_when_the_router_favours_one_expert(top_k: int) -> None:
    cfg = MoEConfig(GPTConfig(seq_len=16, d_model=8, n_layer=1, n_head=2), experts=4, top_k=top_k, hidden=8)
    ffn = MoEFeedForward(cfg)
    torch.nn.init.normal_(ffn.w_in, generator=torch.Generator().manual_seed(0))
    torch.nn.init.normal_(ffn.w_out, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ffn.router.weight.zero_()
        ffn.router.weight[2].fill_(2.0)  # expert 2 gets logit 16 for an all-ones input
    with torch.no_grad():
        y = ffn(torch.ones(1, 5, 8))
    assert y.shape == (1, 5, 8) and torch.isfinite(y).all()
    assert ffn.counts is not None and ffn.aux_loss is not None
    assert int(ffn.counts[2]) == 5  # every token chose expert 2
    # P_2 ~ 1 and f_2 = 1/top_k: aux ~ experts / top_k, well above the balanced 1.0
    assert float(ffn.aux_loss) == pytest.approx(4 / top_k, rel=1e-3)
    assert float(ffn.aux_loss) > 1.5


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"expert": 4}, r"\['expert'\] unknown to the moe workload; allowed: \['aux_loss_coef', 'expert_hidden'"),
        ({"experts": 4, "top_k": 5}, r"options.top_k must be an integer in 1..experts \(4\), got 5"),
        ({"top_k": 0}, r"options.top_k must be an integer in 1..experts \(4\), got 0"),
        ({"aux_loss_coef": -0.1}, r"options.aux_loss_coef must be a finite number >= 0, got -0.1"),
        ({"aux_loss_coef": float("nan")}, r"options.aux_loss_coef must be a finite number >= 0, got nan"),
        ({"aux_loss_coef": "0.1"}, r"options.aux_loss_coef must be a finite number >= 0, got '0.1'"),
        ({"experts": 0}, r"options.experts must be an integer in 1..64, got 0"),
        ({"experts": 65}, r"options.experts must be an integer in 1..64, got 65"),
        ({"experts": True}, r"options.experts must be an integer in 1..64, got True"),
        ({"expert_hidden": 0}, r"options.expert_hidden must be an integer >= 1, got 0"),
    ],
)
def test_bad_options_are_one_line_config_errors(options: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        workload(**options)
    assert "\n" not in str(err.value)


def test_options_set_the_model_shape() -> None:
    w = workload(experts=3, top_k=1, expert_hidden=16, aux_loss_coef=0)
    shapes = {n: tuple(p.shape) for n, p in w.build_model(0).named_parameters()}
    assert shapes["blocks.0.moe.w_in"] == (3, 32, 16)
    assert shapes["blocks.0.moe.w_out"] == (3, 16, 32)
    assert shapes["blocks.0.moe.router.weight"] == (3, 32)
    assert workload().moe.hidden == 64  # the default: 2 * d_model


@pytest.mark.parametrize("experts", [3, 4])
def test_balanced_fragments_hold_whole_experts(experts: int) -> None:
    w = workload(experts=experts)
    model = w.build_model(0)
    full = {n: tuple(p.shape) for n, p in model.named_parameters()}
    split = False
    for p in (2, 6, 12, 24):
        layout = layout_for(model, w, DiLoCoConfig(num_fragments=p, sync_every=24)).fragments
        rows: dict[str, list[tuple[int, int]]] = {}
        for frag in layout.fragments:
            for pc in frag:
                if pc.name.endswith(EXPERT_TENSORS):
                    # a piece is rows [start, end) of dim 0, the expert index: whole experts
                    assert pc.shape == (pc.row_end - pc.row_start, *full[pc.name][1:]), pc
                    rows.setdefault(pc.name, []).append((pc.row_start, pc.row_end))
        for name, ranges in rows.items():
            ranges.sort()
            assert ranges[0][0] == 0 and ranges[-1][1] == experts, name
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), name
            split = split or len(ranges) > 1
    assert split  # the layouts above did split expert tensors, so the check was not vacuous


def test_a_short_simulated_run_trains() -> None:
    settings = [f"workload.factory={FACTORY}", *(f"workload.{k}={v}" for k, v in TINY.items())]
    settings += [
        "workload.eval_windows=64",
        "workload.options={experts = 4, top_k = 2}",
        "run.num_learners=2",
        "run.processed_tokens=6000",
        "run.eval_points=1",
        "algo.sync_every=4",
    ]
    cfg = load_config(None, settings, base=PRESETS["decoupled"])
    result = simulate(cfg)
    assert math.isfinite(result.final_loss)
    assert any(e["event"] == "round" for e in result.tape)  # fragments with experts were merged
    assert result.final_loss < math.log(256)  # below the uniform guess over bytes: it learned
    assert tuple(result.state["blocks.0.moe.w_in"].shape) == (4, 32, 64)


def test_the_example_config_loads() -> None:
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "moe.toml").validate()
    w = load_workload(cfg.workload)
    assert isinstance(w, MoEWorkload)
    assert (w.moe.experts, w.moe.top_k, w.moe.hidden, w.aux_loss_coef) == (4, 2, 128, 0.01)
