"""A model's buffers are part of the global model: BatchNorm's running statistics and
``num_batches_tracked`` travel in fragments, are merged by their own rule (the token-weighted
mean of the answers' values, no outer step), are refused when hostile, and reach the
simulator's evaluation, the syncer's final model, the export and a joining learner."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_syncer import BASE, Driver, beat, payload, requests, updates
from torch import nn

import ddiloco
from ddiloco.config import load_config
from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import TensorSpec, balanced_layout
from ddiloco.core.messages import Heartbeat
from ddiloco.core.syncer import Syncer
from ddiloco.errors import UsageError
from ddiloco.training.layout import layout_of, load_global, param_spec, persistent_buffers, synced_tensors


class BNNet(nn.Module):
    """A user's small classifier with BatchNorm (and a non-persistent buffer that stays local)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 3)
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.bn(self.fc1(x))))


def test_persistent_buffers_are_synced_tensors_with_their_kind_and_never_split():
    model = BNNet()
    assert list(persistent_buffers(model)) == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    named = synced_tensors(model)
    assert "scratch" not in named and set(named) == set(model.state_dict())
    layout = layout_of(model, DiLoCoConfig(num_fragments=3), lambda _: False)
    kinds = {pc.name: pc.kind for frag in layout.fragments.fragments for pc in frag}
    assert kinds["bn.running_mean"] == kinds["bn.running_var"] == "buffer"
    assert kinds["bn.num_batches_tracked"] == "count" and kinds["fc1.weight"] == "param"
    pieces = [pc for frag in layout.fragments.fragments for pc in frag if pc.kind != "param"]
    assert all(pc.row_start == 0 and (not pc.shape or pc.row_end == pc.shape[0]) for pc in pieces)
    assert [n for n, _ in param_spec(model)][-3:] == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    flat = [pc for frag in layout.fragments.fragments for pc in frag]
    assert not any(emb for emb, pc in zip(layout.embedding_like, flat) if pc.kind != "param")


def test_a_layout_without_buffers_keeps_its_digest():
    import hashlib
    import json

    plain = balanced_layout([TensorSpec("w", (4, 2)), TensorSpec("b", (4,))], 1)
    before = json.dumps([[[pc.name, pc.row_start, pc.row_end, list(pc.shape)] for pc in f] for f in plain.fragments])
    assert plain.digest() == hashlib.sha256(before.encode()).hexdigest()[:16]  # as computed before buffers
    with_kind = balanced_layout([TensorSpec("w", (4, 2)), TensorSpec("b", (4,), "buffer")], 1)
    assert with_kind.digest() != plain.digest()  # a buffer is not a parameter of the same shape


# -- the merge rule, on the core ------------------------------------------------------------

CFG = DiLoCoConfig(**{**BASE.__dict__, "merge": "rda", "outer_lr": 0.5, "outer_momentum": 0.9})


def core_with_buffers(cfg: DiLoCoConfig = CFG, learners=(0, 1, 2)) -> Driver:
    # BatchNorm's names: the variance rule goes by the name (running_var).
    specs = [
        TensorSpec("w", (4,)),
        TensorSpec("bn.running_mean", (4,), "buffer"),
        TensorSpec("bn.running_var", (4,), "buffer"),
        TensorSpec("bn.num_batches_tracked", (), "count"),
    ]
    layout = balanced_layout(specs, 1)
    init = {
        "w": torch.zeros(4),
        "bn.running_mean": torch.zeros(4),
        "bn.running_var": torch.ones(4),
        "bn.num_batches_tracked": torch.tensor(0.0),
    }
    s = Driver(Syncer(cfg, layout, init, [False] * 4))
    for m in learners:
        s.on_join(m, 0.0)
        s.on_heartbeat(Heartbeat(m, 0, 0, 1.0), 0.0)
    return s


def values(s: Driver) -> dict[str, torch.Tensor]:
    return s.core.global_state()


def answer(m: int, w: float, mean: float, var: float, count: float, tokens: int = 10, steps: int = 1):
    by_name = {
        "w": torch.full((4,), w),
        "bn.running_mean": torch.full((4,), mean),
        "bn.running_var": torch.full((4,), var),
        "bn.num_batches_tracked": torch.tensor(float(count)),
    }
    return payload(m, [by_name[pc.name] for pc in LAYOUT_ORDER], tokens=tokens, steps=steps)


LAYOUT_ORDER = core_with_buffers().core.layout.fragments[0]


def test_statistics_from_stale_bases_do_not_add_up():
    """Statistics are levels: two learners that both measured a mean of 2 from version 0 leave
    the global mean at 2, whichever round each lands in (changes would add up to 4)."""
    s = core_with_buffers(learners=(0, 1))
    beat(s, 3.5, learners=(0, 1))
    s.poll(4.0)
    s.on_contribution(answer(0, w=1.0, mean=2.0, var=1.0, count=1), 4.1)
    s.flush(4.2)
    assert s.core.fragments[0].version == 1
    beat(s, 7.5, learners=(0, 1))
    s.poll(8.0)
    s.on_contribution(answer(1, w=1.0, mean=2.0, var=1.0, count=1), 8.1)  # still from version 0
    s.flush(8.2)
    assert s.core.fragments[0].version == 2
    assert torch.allclose(values(s)["bn.running_mean"], torch.full((4,), 2.0))


def test_buffers_take_the_token_weighted_mean_of_the_answers_and_parameters_the_outer_step():
    s = core_with_buffers()
    beat(s, 3.5)
    assert requests(s.poll(4.0)) == [0, 1, 2]
    s.on_contribution(answer(0, w=1.0, mean=2.0, var=4.0, count=3, tokens=10), 4.1)
    s.on_contribution(answer(1, w=1.0, mean=5.0, var=1.0, count=5, tokens=20), 4.2)  # weight 400 vs 100
    assert updates(s.flush(4.3)) == [0, 1]
    g = values(s)
    assert torch.allclose(g["bn.running_mean"], torch.full((4,), (2.0 * 100 + 5.0 * 400) / 500))
    assert torch.allclose(g["bn.running_var"], torch.full((4,), (4.0 * 100 + 1.0 * 400) / 500))
    assert float(g["bn.num_batches_tracked"]) == round((3 * 100 + 5 * 400) / 500)  # an integer, 4.6 -> 5
    # the parameter moved by the outer step (lr 0.5, momentum 0.9, Nesterov: 0.5 * 1.9 * delta)
    assert torch.allclose(g["w"], torch.full((4,), 0.5 * 1.9 * 1.0))
    assert s.core.fragments[0].outer.buffers is not None
    momentum = zip(s.core.fragments[0].outer.buffers, LAYOUT_ORDER)
    assert all(float(b.abs().max()) == 0 for b, pc in momentum if pc.kind != "param")  # none on statistics


@pytest.mark.parametrize(
    ("mean", "var", "count", "line"),
    [
        (math.nan, 1.0, 1, "buffer bn.running_mean: non-finite values"),
        (0.0, -0.5, 1, "buffer bn.running_var: a negative variance (-0.5)"),
        (
            0.0,
            1.0,
            1e7,
            "buffer bn.num_batches_tracked: a count moved by 10000000 in 1 steps (allowed: 0 .. 64, "
            "max_count_per_step = 64)",
        ),
        (0.0, 1.0, 2.5, "buffer bn.num_batches_tracked: a count must be a non-negative integer"),
        (3e6, 1.0, 1, "buffer bn.running_mean: changed by 6e+06, beyond max_delta_norm = 1e+06"),
    ],
)
def test_hostile_buffers_are_refused_with_the_reason(mean, var, count, line):
    s = core_with_buffers()
    beat(s, 3.5)
    s.poll(4.0)
    s.on_contribution(answer(0, w=1.0, mean=mean, var=var, count=count), 4.1)
    rejection = s.last_rejection()
    assert rejection["reason"] == "bad_buffer" and rejection["detail"] == line
    assert float(values(s)["bn.num_batches_tracked"]) == 0 and torch.equal(values(s)["bn.running_var"], torch.ones(4))


def test_the_robust_merge_clips_one_answers_statistics_to_the_rounds_median_change():
    s = core_with_buffers(DiLoCoConfig(**{**CFG.__dict__, "robust": True}))
    beat(s, 3.5)
    s.poll(4.0)
    s.on_contribution(answer(0, w=1.0, mean=1.0, var=1.0, count=2), 4.1)
    s.on_contribution(answer(1, w=1.1, mean=1.2, var=1.0, count=2), 4.1)
    s.on_contribution(answer(2, w=0.9, mean=1000.0, var=1.0, count=2), 4.1)  # a hostile statistic
    s.flush(4.3)
    mean = values(s)["bn.running_mean"]
    # each answer is clipped to the median (1.2) +- 3x the median distance from it (0.2): <= 1.8
    assert float(mean.min()) >= 1.0 and float(mean.max()) <= 1.8 + 1e-5
    assert float(values(s)["bn.num_batches_tracked"]) == 2


# -- through the drivers --------------------------------------------------------------------


def shifted_data(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs far from BatchNorm's initial statistics (mean 3, scale 2): a model evaluated
    with fresh statistics is badly wrong, one with learned statistics is right."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 3, generator=torch.Generator().manual_seed(99))
    out = []
    for _ in range(n):
        x = 3.0 + 2.0 * torch.randn(32, 8, generator=g)
        out.append((x, ((x - 3.0) @ w).argmax(1)))
    return out


def bn_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def evaluate(model: nn.Module, batches) -> float:
    model.eval()
    with torch.no_grad():
        return sum(float(bn_loss(model, b)) for b in batches) / len(batches)


def test_the_simulator_evaluates_the_global_model_with_its_merged_statistics():
    from ddiloco.sim.run import simulate

    torch.set_num_threads(1)
    torch.manual_seed(0)
    train, held = shifted_data(1, 64), shifted_data(2, 4)
    wl = ddiloco.workload_from(BNNet(), bn_loss, train, eval_batches=held, tokens=lambda b: len(b[1]))
    settings = ["run.num_learners=2", "run.processed_tokens=6400", "run.eval_points=1", "algo.sync_every=4"]
    cfg = load_config(None, [*settings, "inner.lr=0.01"])
    result = simulate(cfg, wl)
    state = result.state
    assert float(state["bn.num_batches_tracked"]) > 0
    assert float(state["bn.running_mean"].abs().mean()) > 0.1  # learned, not the initial zeros
    fresh = BNNet()
    load_global(fresh, state)
    assert evaluate(fresh, held) == pytest.approx(result.final_loss, rel=1e-5)
    stale = BNNet()
    stale.load_state_dict({k: v for k, v in state.items() if "running" not in k and "tracked" not in k}, strict=False)
    assert evaluate(stale, held) > 1.5 * result.final_loss  # what the run reported before buffers were synced


def test_load_global_is_strict():
    model = BNNet()
    state = synced_tensors(BNNet())
    del state["bn.running_var"]
    with pytest.raises(UsageError, match=r"missing \['bn.running_var'\]"):
        load_global(model, state)
    with pytest.raises(UsageError, match=r"unknown \['extra'\]"):
        load_global(model, {**synced_tensors(BNNet()), "extra": torch.zeros(1)})


def test_a_batchnorm_model_through_learner_and_syncer_server_exports_its_statistics(tmp_path):
    """The tutorial's loop with a BatchNorm model, to the run's end: the exported global model,
    loaded strictly into a fresh model, holds the learners' merged statistics and scores what
    the learners' own models score after the final sync (within 3%), without recalibration;
    the same weights with fresh statistics score far worse. (The quality of a longer run
    against a plain one is bench/library.py's: a threaded run's trajectory is not repeatable.)"""
    import threading

    from test_library import SETTINGS

    from ddiloco.service.base.transport import InProcessNetwork

    torch.set_num_threads(1)
    address = "inproc://buffers-syncer"
    cfg = load_config(None, [*SETTINGS, "algo.sync_every=8", "run.processed_tokens=5120"])
    net = InProcessNetwork()
    torch.manual_seed(0)
    server = ddiloco.SyncerServer(BNNet(), address, tmp_path, config=cfg, transport=net.syncer(address), fsync=False)
    server.start()
    held = shifted_data(2, 4)
    models: dict[int, nn.Module] = {}
    ended: dict[int, bool] = {}
    errors: list[BaseException] = []

    def run(m: int) -> None:
        try:
            torch.manual_seed(10 + m)
            model = BNNet()
            opt = torch.optim.Adam(model.parameters(), lr=0.003)
            learner = ddiloco.Learner(model, address, learner_id=m, config=cfg, transport=net.learner)
            data = shifted_data(100 + m, 400)
            for x, y in data:
                if learner.run_ended:
                    break
                model.train()
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                learner.step(tokens=len(y))
            ended[m] = learner.finish()  # the final sync: the learner takes the final model
            models[m] = model
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(m,)) for m in (0, 1)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
    finally:
        path = server.stop()
    assert not errors, errors
    assert ended == {0: True, 1: True}
    exported = BNNet()
    exported.load_state_dict(ddiloco.load_state_dict(path))  # strict: every key, buffers included
    assert float(exported.bn.num_batches_tracked) > 0
    assert float(exported.bn.running_var.min()) > 0 and float(exported.bn.running_mean.abs().mean()) > 0.1
    for m in (0, 1):
        assert torch.allclose(models[m].bn.running_var, exported.bn.running_var)
    own = sum(evaluate(models[m], held) for m in (0, 1)) / 2
    assert evaluate(exported, held) <= 1.03 * own
    fresh_stats = BNNet()
    fresh_stats.load_state_dict({k: v for k, v in exported.state_dict().items() if "bn.running" not in k}, strict=False)
    assert evaluate(fresh_stats, held) > 1.5 * evaluate(exported, held)  # an export without the statistics


def test_a_joining_learner_takes_the_global_statistics(tmp_path):
    """A learner that joins a run under way (a new one, or a restarted process) starts from the
    global model's statistics, not its own fresh ones."""
    from helpers import wait_for
    from test_library import SETTINGS

    from ddiloco.service.base.transport import InProcessNetwork

    torch.set_num_threads(1)
    address = "inproc://buffers-join"
    cfg = load_config(None, [*SETTINGS, "algo.sync_every=4"])
    net = InProcessNetwork()
    torch.manual_seed(0)
    server = ddiloco.SyncerServer(BNNet(), address, tmp_path, config=cfg, transport=net.syncer(address), fsync=False)
    server.start()
    try:
        first = BNNet()
        opt = torch.optim.Adam(first.parameters(), lr=0.003)
        with ddiloco.Learner(first, address, learner_id=0, config=cfg, transport=net.learner) as learner:
            core = server.service.core
            p = next(i for i, f in enumerate(core.layout.fragments) if any(pc.name == "bn.running_mean" for pc in f))
            batches = iter(shifted_data(100, 400))

            def merged_statistics() -> bool:
                x, y = next(batches)
                first.train()
                F.cross_entropy(first(x), y).backward()
                opt.step()
                opt.zero_grad()
                learner.step(tokens=len(y))
                return core.fragments[p].version >= 2

            wait_for(merged_statistics, 60, "two merges of the statistics' fragment")
            joined = BNNet()  # its own fresh statistics: zeros and ones
            with ddiloco.Learner(joined, address, learner_id=1, config=cfg, transport=net.learner) as second:
                version = second.versions[p]
                took = dict(zip((pc.name for pc in core.layout.fragments[p]), core.fragments[p].at(version).values))
                assert version >= 2  # (a round may have closed since: compare with the version it took)
                assert torch.equal(joined.bn.running_mean, took["bn.running_mean"])
                assert float(joined.bn.running_mean.abs().sum()) > 0  # not its own fresh zeros
                for name in ("bn.running_var", "bn.num_batches_tracked"):
                    if name in took:  # (the layout may place a statistic in another fragment)
                        assert torch.equal(joined.state_dict()[name].float(), took[name])
    finally:
        server.stop()
